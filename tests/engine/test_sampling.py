"""Sampling: seeded requests reproduce whatever else runs; greedy equivalences; logprobs."""

from __future__ import annotations

import pytest
import torch

from engine import ContinuousBatchingConfig, generate_batch
from tests.engine.conftest import model_for, prompts_for, reference

CFG = dict(block_size=16, num_blocks=256)


def run(prompts, **kwargs):
    out = generate_batch(model_for("llama"), prompts, max_new_tokens=16, ignore_eos=True, progress_bar=False,
                         continuous_batching_config=ContinuousBatchingConfig(**CFG), **kwargs)
    return [o.generated_tokens for o in out.values()]


def test_seeded_sample_is_the_same_alone_or_in_a_batch_of_32() -> None:
    from engine import LLMEngine

    prompts = [list(p) for p in prompts_for()]
    target = prompts[5]
    alone = run([target], temperature=1.0, top_p=0.9, top_k=50, seed=1234)[0]

    engine = LLMEngine(model_for("llama"), ContinuousBatchingConfig(**CFG))
    reqs = []
    for i, p in enumerate(prompts):
        seed = 1234 if i == 5 else None  # the others sample from the engine's own stream
        reqs.append(engine.make_request(p, max_new_tokens=16, ignore_eos=True, temperature=1.0 if i != 5 else 1.0,
                                        top_p=0.9, top_k=50, seed=seed))
        engine.add_request(reqs[-1])
    while engine.has_unfinished():
        engine.step()
    assert reqs[5].generated_ids == alone
    assert alone != list(reference("llama", tuple(target)))[:16]  # it really sampled


def test_a_seeded_sample_at_a_plain_temperature_is_the_same_alone_or_among_other_kinds_of_rows() -> None:
    """Through the engine, whose CPU sampler takes greedy and plain-temperature rows in the kernel's
    race and the others through their candidates: the seeded request's tokens do not change."""
    from engine import LLMEngine

    prompts = [list(p) for p in prompts_for()]
    target = prompts[5]
    alone = run([target], temperature=0.9, seed=77)[0]
    engine = LLMEngine(model_for("llama"), ContinuousBatchingConfig(**CFG))
    assert engine.sampler.race is not None  # the CPU kernel's
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=1.0, top_p=0.8), dict(temperature=0.7, top_k=9)]
    reqs = [engine.make_request(p, max_new_tokens=16, ignore_eos=True,
                                **(dict(temperature=0.9, seed=77) if i == 5 else kinds[i % 4]))
            for i, p in enumerate(prompts)]  # fmt: skip
    for req in reqs:
        engine.add_request(req)
    while engine.has_unfinished():
        engine.step()
    assert reqs[5].generated_ids == alone
    assert alone != list(reference("llama", tuple(target)))[:16]  # it really sampled
    assert [r.generated_ids for r in reqs[::4]] == [list(reference("llama", tuple(p)))[:16] for p in prompts[::4]]


def test_different_seeds_differ_and_same_seed_repeats() -> None:
    p = [list(prompts_for()[3])]
    a = run(p, temperature=1.5, seed=1)[0]
    assert a == run(p, temperature=1.5, seed=1)[0]
    assert a != run(p, temperature=1.5, seed=2)[0]


def test_top_k_1_and_temperature_0_are_greedy() -> None:
    prompts = [list(p) for p in prompts_for()[:8]]
    greedy = [list(reference("llama", tuple(p)))[:16] for p in prompts]
    assert run(prompts, temperature=1.0, top_k=1, seed=3) == greedy
    assert run(prompts, temperature=0.0, seed=3) == greedy
    # below 1e-5 too (l / T would overflow for T near float32's smallest): greedy, not infinities
    assert run(prompts, temperature=1e-40, top_k=0, seed=3) == greedy
    assert run(prompts, temperature=1e-6, top_p=0.9, seed=3) == greedy


def test_logprobs_match_log_softmax_of_the_models_logits() -> None:
    model = model_for("llama")
    prompt = list(prompts_for()[7])
    out = generate_batch(model, [prompt], max_new_tokens=6, ignore_eos=True, progress_bar=False, logprobs=5,
                         continuous_batching_config=ContinuousBatchingConfig(**CFG))["req_0"]
    tokens = out.generated_tokens
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits.float(), dim=-1)
    for step, token in enumerate(tokens):
        assert abs(out.logprobs[step] - expected[step, token].item()) < 1e-4
        top = out.top_logprobs[step]
        values = list(top.values())
        assert values == sorted(values, reverse=True) and len(top) == 5
        for tid, lp in top.items():
            assert abs(lp - expected[step, tid].item()) < 1e-4
        assert set(top) == set(expected[step].topk(5).indices.tolist())


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_logprobs_with_the_kernels_are_torchs(mode) -> None:
    """The CPU backend's race and logsumexp give the logprobs torch's ops give, sampled rows and
    greedy ones, a token's and each row's top ones."""
    from engine.backends.cpu import SDPABackend
    from engine.sampler import Sampler

    backend = SDPABackend()
    logits = _tied_logits(1, 4, vocab=3000)[0].bfloat16()
    reqs = [_request(seed=1, logprobs=3), _request(seed=2, temperature=0.0, logprobs=0), _request(seed=3, top_p=0.8, logprobs=5),
            _request(seed=4)]  # fmt: skip
    fast = Sampler(0, argmax=backend.argmax, race=backend.sample_race, logsumexp=backend.logsumexp,
                   logprobs_mode=mode)(logits, reqs)  # fmt: skip
    plain = Sampler(0, logprobs_mode=mode)(logits, reqs)
    assert fast.tokens[1] == plain.tokens[1] == int(logits[1].float().argmax())
    raw = torch.log_softmax(logits.float(), dim=-1)
    for row, token in enumerate(fast.tokens):
        if mode == "raw_logprobs":
            assert abs(fast.logprobs[row] - raw[row, token].item()) < 1e-5
    for got, want in zip(fast.top_logprobs, plain.top_logprobs):
        assert (got is None) == (want is None)
        if got is not None and mode == "raw_logprobs":
            assert got.keys() == want.keys() and all(abs(got[t] - want[t]) < 1e-5 for t in got)


def test_min_new_tokens_holds_eos_back_and_eos_stops() -> None:
    model = model_for("llama")
    prompt = list(prompts_for()[2])
    free = list(reference("llama", tuple(prompt)))
    first = next(i for i in range(3, len(free)) if free[i] not in free[:i])
    eos = free[first]  # pretend this greedy token, new at step `first`, is EOS
    cfg = ContinuousBatchingConfig(**CFG)
    stopped = generate_batch(model, [prompt], max_new_tokens=20, eos_token_id=eos, progress_bar=False,
                             continuous_batching_config=cfg)["req_0"]
    assert stopped.generated_tokens == free[: first + 1] and stopped.finish_reason == "stop"
    held = generate_batch(model, [prompt], max_new_tokens=20, eos_token_id=eos, min_new_tokens=first + 3, progress_bar=False,
                          continuous_batching_config=cfg)["req_0"]
    assert len(held.generated_tokens) >= first + 3 and eos not in held.generated_tokens[: first + 2]


def test_repetition_penalty_matches_model_generate() -> None:
    model = model_for("qwen2")
    prompts = [list(p) for p in prompts_for()[:6]]
    out = generate_batch(model, prompts, max_new_tokens=16, ignore_eos=True, progress_bar=False, repetition_penalty=1.8,
                         continuous_batching_config=ContinuousBatchingConfig(**CFG))
    for p, o in zip(prompts, out.values()):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, repetition_penalty=1.8,
                                 eos_token_id=None, pad_token_id=3)
        assert o.generated_tokens == ref[0, len(p):].tolist()


def test_logit_bias_forces_a_token() -> None:
    out = run([list(prompts_for()[4])], logit_bias={77: 1000.0})
    assert out[0] == [77] * 16


def test_logit_bias_is_made_into_tensors_once_and_rounded_once_to_the_logits_dtype() -> None:
    """A request may bias the whole vocabulary: its tensors are made once (SamplingParams.bias), not at
    each step of each sample, and each bias is rounded once, from the client's number to the logits' dtype."""
    biases = {i: 0.1 + i / 3 for i in range(0, 1000, 7)}
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.zeros(1, 1000, dtype=dtype)
        sampler, req = _sampler_rows(logits, logit_bias=biases)
        assert req.sampling.bias is req.sampling.bias
        processed = sampler._process(logits, [req])[0]
        want = torch.zeros(1000, dtype=dtype)
        want[list(biases)] = torch.tensor(list(biases.values()), dtype=dtype)
        assert torch.equal(processed, want)


def _sampler_rows(logits: torch.Tensor, **params):
    from engine.request import Request, SamplingParams
    from engine.sampler import Sampler

    req = Request("r", [1, 2, 3], 8, SamplingParams(**params), frozenset())
    req.token_ids += [5, 5, 6]  # generated so far: 5 twice, 6 once
    return Sampler(seed=0), req


def test_presence_and_frequency_penalties_follow_openai() -> None:
    logits = torch.zeros(1, 10)
    sampler, req = _sampler_rows(logits, presence_penalty=0.5, frequency_penalty=0.25)
    processed = sampler._process(logits, [req])[0]
    assert processed[5].item() == -0.5 - 0.5 and processed[6].item() == -0.5 - 0.25
    assert processed[7].item() == 0.0 and processed[1].item() == 0.0  # prompt tokens are not penalised


def test_top_p_and_min_p_cut_the_tail() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for params, allowed in [(dict(top_p=0.5), {0}), (dict(top_p=0.7), {0, 1}), (dict(min_p=0.5), {0, 1}),
                            (dict(top_k=3), {0, 1, 2})]:
        sampler, req = _sampler_rows(logits, temperature=1.0, **params)
        seen = {sampler(logits, [req]).tokens[0] for _ in range(300)}
        assert seen == allowed, params


def test_stop_string_spanning_tokens_cuts_the_text_exactly() -> None:
    from engine.testing import build_test_tokenizer

    tok = build_test_tokenizer()
    model = model_for("llama")
    prompt = list(prompts_for()[9])
    cfg = ContinuousBatchingConfig(**CFG)
    free = generate_batch(model, [prompt], max_new_tokens=30, ignore_eos=True, progress_bar=False,
                          continuous_batching_config=cfg)["req_0"]
    text = tok.decode(free.generated_tokens)
    stop = text[6:10]  # four characters from the middle of the greedy text
    out = generate_batch(model, [prompt], max_new_tokens=30, ignore_eos=True, progress_bar=False, tokenizer=tok,
                         stop_strings=[stop, "never appears"], continuous_batching_config=cfg)["req_0"]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop"
    assert out.generated_tokens == free.generated_tokens[: len(out.generated_tokens)]
    assert len(out.generated_tokens) < 30
    # no stop string in the text: it runs to its length
    full = generate_batch(model, [prompt], max_new_tokens=30, ignore_eos=True, progress_bar=False, tokenizer=tok,
                          stop_strings=["never appears"], continuous_batching_config=cfg)["req_0"]
    assert full.finish_reason == "length" and full.text == text


def test_stop_strings_without_a_tokenizer_are_refused() -> None:
    import pytest

    out = generate_batch(model_for("llama"), [[1, 2, 3]], max_new_tokens=4, stop_strings=["x"], progress_bar=False,
                         continuous_batching_config=ContinuousBatchingConfig(**CFG))["req_0"]
    assert out.finish_reason == "error" and "tokenizer" in out.error
    with pytest.raises(ValueError, match="stop_strings must be"):
        from engine import LLMEngine
        from engine.testing import build_test_tokenizer

        LLMEngine(model_for("llama"), ContinuousBatchingConfig(**CFG), tokenizer=build_test_tokenizer()).make_request(
            [1, 2], max_new_tokens=2, stop_strings=[1])


def test_bf16_decode_path_matches_float32_attention() -> None:
    from engine.backends.cpu import _attention, _grouped_decode_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g) for s in ((5, 8, 16), (5, 2, 40, 16), (5, 2, 40, 16)))
    mask = (torch.arange(40)[None] < torch.tensor([40, 3, 17, 1, 29])[:, None])[:, None, None, :]
    ref = _attention(q.unsqueeze(2), k, v, mask, 0.25, None, True).squeeze(2)
    low = _grouped_decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.25).float()
    assert (low - ref).abs().max() < 0.05
    assert torch.allclose(_grouped_decode_attention(q, k, v, mask, 0.25), ref, atol=1e-5)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_every_sampling_tensor_is_made_on_the_logits_device(mode) -> None:
    """Logits on torch's meta device: any tensor the sampler builds on the host and mixes with them
    raises a device mismatch, so reaching the final copy-out (which meta cannot do) shows that every
    step (bias, penalties, EOS ban, temperature, top-k/p, min-p, noise, logprobs) stayed on the
    logits' device, as it must for CUDA logits."""
    from engine import ContinuousBatchingConfig, LLMEngine
    from engine.sampler import Sampler
    from tests.engine.conftest import VOCAB, model_for

    engine = LLMEngine(model_for("llama"), ContinuousBatchingConfig(block_size=16, num_blocks=32))
    asks = [dict(temperature=0.0), dict(temperature=0.8, top_k=5, seed=3), dict(temperature=1.2, top_p=0.5, min_p=0.1),
            dict(temperature=0.7, logit_bias={4: 2.0}, repetition_penalty=1.3, presence_penalty=0.5,
                 frequency_penalty=0.5, min_new_tokens=3, eos_token_id=2, logprobs=3)]  # fmt: skip
    reqs = [engine.make_request([5, 6, 7, 5], max_new_tokens=8, **ask) for ask in asks]
    for req in reqs:
        req.token_ids.append(9)  # one generated token: the penalties have something to count
    logits = torch.empty(len(reqs), VOCAB, device="meta")
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        Sampler(seed=0, logprobs_mode=mode)(logits, reqs, default_logprobs=True)


def _request(seed=None, **params):
    from engine.request import Request, SamplingParams

    return Request(f"r{seed}", [1, 2, 3], 64, SamplingParams(**{"temperature": 1.0, **params}, seed=seed), frozenset())


def _tied_logits(steps: int, rows: int, vocab: int = 1000) -> list[torch.Tensor]:
    """Logits rounded to bfloat16, as a bf16 model's are: many exact ties among the top ones."""
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(rows, vocab, generator=g) * 3).bfloat16().float() for _ in range(steps)]


def _race(kind: str):
    """The sampler's one-pass race: "kernel" the CPU backend's (engine/csrc/sample_cpu.cpp), "none" without
    it (torch's ops, as on a backend that has none)."""
    if kind == "none":
        return None
    from engine.backends.cpu import SDPABackend

    backend = SDPABackend()
    assert backend.ops is not None, "the C++ kernels must build here"
    return backend.sample_race


@pytest.mark.parametrize("race", ["kernel", "none"])
@pytest.mark.parametrize("target", [dict(top_k=5), dict(top_k=40, top_p=0.8), dict(top_p=0.9), dict(), dict(min_p=0.05),
                                    dict(temperature=0.6, top_k=2000)])  # fmt: skip
def test_a_seeded_row_draws_the_same_tokens_whatever_the_batch_makes_the_sampler_do(target, race) -> None:
    """A seeded request alone, then with rows that make the sampler take the batch's largest top-k,
    sort the whole vocabulary (top-p with a row without top-k), keep it as it is, or (with the race)
    send other rows down the candidates' path beside it: the same tokens."""
    from engine.sampler import Sampler

    companions = [[], [dict(top_k=50)], [dict(top_k=3, top_p=0.5), dict()], [dict(top_p=0.7)], [dict(), dict(min_p=0.1)],
                  [dict(top_k=2000)], [dict(temperature=0.0)]]  # fmt: skip
    logits = _tied_logits(12, 3)
    runs = []
    for others in companions:
        reqs = [_request(seed=5, **target)] + [_request(**o) for o in others]
        sampler = Sampler(seed=1, race=_race(race))
        runs.append([sampler(step[: len(reqs)], reqs).tokens[0] for step in logits])
    assert all(run == runs[0] for run in runs), runs
    assert len(set(runs[0])) > 1


@pytest.mark.parametrize("race", ["kernel", "none"])
@pytest.mark.parametrize("params", [dict(top_k=3), dict(top_p=0.7), dict(top_k=3, top_p=0.6), dict(min_p=0.3), dict()])
@pytest.mark.parametrize("seeded", [False, True])
def test_sampled_frequencies_follow_the_kept_distribution(params, seeded, race) -> None:
    """Many rows over one distribution: the tokens drawn come at the renormalised probabilities of
    the tokens top-k, top-p and min-p keep (transformers' rules), seeded rows (each its own stream)
    and unseeded ones alike."""
    from engine.sampler import Sampler

    p = torch.tensor([0.35, 0.25, 0.15, 0.1, 0.08, 0.07])
    kept = torch.ones(6, dtype=torch.bool)
    if "top_k" in params:
        kept[params["top_k"]:] = False
    if "top_p" in params:
        q = torch.where(kept, p, 0.0) / torch.where(kept, p, 0.0).sum()
        kept &= (torch.cumsum(q, 0) - q) < params["top_p"]
    if "min_p" in params:
        kept &= p >= params["min_p"] * p.max()
    want = torch.where(kept, p, 0.0) / torch.where(kept, p, 0.0).sum()
    rows = 3000
    reqs = [_request(seed=i if seeded else None, **params) for i in range(rows)]
    tokens = Sampler(seed=2, race=_race(race))(torch.log(p).repeat(rows, 1), reqs).tokens
    freq = torch.bincount(torch.tensor(tokens), minlength=6).float() / rows
    assert torch.all(freq[~kept] == 0)
    assert (freq - want).abs().max() < 0.035, (freq, want)


def test_top_k_rows_sort_only_their_candidates(monkeypatch) -> None:
    """With a top-k on every sampled row, nothing as wide as the vocabulary is sorted."""
    from engine.sampler import Sampler

    widths = []
    sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **k: widths.append(self.shape[-1]) or sort(self, *a, **k))
    reqs = [_request(seed=3, top_k=20, top_p=0.9), _request(top_k=50, min_p=0.05), _request(top_k=7)]
    Sampler(seed=0)(_tied_logits(1, 3, vocab=4096)[0], reqs)
    assert widths and max(widths) == 50


@pytest.mark.parametrize("candidates", [4, 16, 256])
def test_top_p_over_the_vocabularys_top_draws_what_the_full_sort_draws(monkeypatch, candidates) -> None:
    """Top-p rows take their nucleus from the vocabulary's top NUCLEUS_CANDIDATES when it ends there
    (engine/sampler.py, _nucleus_candidates), else sort it all: the same tokens as with the full sort
    always, for bfloat16 logits whose ties fall across the candidates' edge too."""
    import engine.sampler as sampler_module
    from engine.sampler import Sampler

    g = torch.Generator().manual_seed(3)
    steps = [(torch.randn(6, 1000, generator=g) * scale).bfloat16().float() for scale in (1, 3, 6, 9) for _ in range(5)]

    def draw(n: int) -> tuple[list[list[int]], int]:
        monkeypatch.setattr(sampler_module, "NUCLEUS_CANDIDATES", n)
        taken = 0
        real = sampler_module._nucleus_candidates

        def counted(*args):
            nonlocal taken
            out = real(*args)
            taken += out is not None
            return out

        monkeypatch.setattr(sampler_module, "_nucleus_candidates", counted)
        reqs = [_request(seed=i, top_p=p) for i, p in enumerate([0.9, 0.5, 0.95, 0.8, 0.99, 0.3])]
        sampler = Sampler(seed=4)
        tokens = [sampler(step, reqs).tokens for step in steps]
        monkeypatch.setattr(sampler_module, "_nucleus_candidates", real)
        return tokens, taken

    full, taken = draw(0)
    assert taken == 0
    top, taken = draw(candidates)
    assert top == full
    assert 0 < taken < len(steps) or candidates == 256  # some steps end within the candidates, some not
    assert taken > 0


def test_the_vocabularys_top_is_declined_when_the_nucleus_reaches_tokens_tied_at_its_edge(monkeypatch) -> None:
    """Which of several tied tokens `topk` keeps at its edge is not defined: when the nucleus may reach
    into them, the whole vocabulary is sorted instead."""
    import engine.sampler as sampler_module

    monkeypatch.setattr(sampler_module, "NUCLEUS_CANDIDATES", 4)
    logits = torch.full((1, 20), -4.0)
    logits[0, [0, 1, 2]] = torch.tensor([5.0, 4.0, 3.0])
    logits[0, [10, 11, 12, 13]] = 2.0  # ranks 4-7, across the edge of the top 4
    probs = torch.softmax(logits, dim=-1)[0]
    above_rank_4 = probs[[0, 1, 2]].sum().item()  # the mass ranked above the first tied token

    def candidates(top_p: float):
        return sampler_module._nucleus_candidates(logits, torch.softmax(logits, dim=-1), torch.tensor([top_p]), [True])

    assert candidates(above_rank_4 - 0.01) is not None  # the nucleus ends before the tied tokens
    assert candidates(above_rank_4 + 0.01) is None  # it takes one of them: which one, only the sort says
