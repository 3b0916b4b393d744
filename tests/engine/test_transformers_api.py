"""transformers' continuous-batching guide, run on cbserve: its examples adapted only in the import
(`use_cbserve(model)`), every config field and generate_batch argument of transformers accepted,
persistent managers that an RL loop reuses, and generation_config read as model.generate reads it."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math

import pytest
import torch
from transformers import GenerationConfig

from engine import ContinuousBatchingConfig, RequestStatus, use_cbserve
from engine.testing import build_test_model, build_test_tokenizer
from tests.engine.conftest import VOCAB

CB = dict(block_size=16, num_blocks=128)
PROMPTS = ["Whats up?", "Name a cat breed.", "Write a detailed history of quantum mechanics."]


@pytest.fixture
def model():
    """A fresh model per test (managers are kept on the model), with transformers' generate intact."""
    return use_cbserve(build_test_model("llama", vocab_size=VOCAB))


@pytest.fixture(scope="module")
def tokenizer():
    return build_test_tokenizer(VOCAB)


def generate(model, ids: list[int], config: GenerationConfig | None = None, **kwargs) -> list[int]:
    """transformers' own model.generate, greedy unless the config samples."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), generation_config=config, pad_token_id=3, **kwargs)
    return out[0, len(ids) :].tolist()


# -- the guide's examples --------------------------------------------------------------------------
def test_guide_generate_batch(model, tokenizer) -> None:
    inputs = [tokenizer.encode(p) for p in PROMPTS]
    generation_config = GenerationConfig(max_new_tokens=16, eos_token_id=tokenizer.eos_token_id)
    outputs = model.generate_batch(inputs=inputs, generation_config=generation_config,
                                   continuous_batching_config=ContinuousBatchingConfig(**CB))  # fmt: skip
    assert list(outputs) == ["req_0", "req_1", "req_2"]
    for ids, (request_id, output) in zip(inputs, outputs.items()):
        text = tokenizer.decode(output.generated_tokens, skip_special_tokens=True)
        assert isinstance(text, str) and request_id == output.request_id
        assert output.generated_tokens == generate(model, ids, generation_config)


def test_guide_context_manager_iterates_until_every_request_is_done(model, tokenizer) -> None:
    generation_config = GenerationConfig(max_new_tokens=64, eos_token_id=tokenizer.eos_token_id)
    asked = {"long": ("Write a detailed history of quantum mechanics.", 48), "short_0": ("What's up?", 8),
             "short_1": ("Name a cat breed.", 8)}  # fmt: skip
    results = {}
    with model.continuous_batching_context_manager(generation_config=generation_config,
                                                   continuous_batching_config=ContinuousBatchingConfig(**CB)) as manager:  # fmt: skip
        for request_id, (prompt, max_new) in asked.items():
            manager.add_request(input_ids=tokenizer.encode(prompt), request_id=request_id, max_new_tokens=max_new)
        for result in manager:  # ends once every request is done (transformers' loops until stop)
            results[result.request_id] = result
    assert set(results) == set(asked)
    for request_id, (prompt, max_new) in asked.items():
        ids = tokenizer.encode(prompt)
        assert results[request_id].generated_tokens == generate(model, ids, generation_config, max_new_tokens=max_new)
    assert not manager.is_running()
    with pytest.raises(RuntimeError, match="destroyed"):
        manager.start()  # destroyed on exit: persistent_manager was False


def test_guide_init_streaming_and_shutdown(model, tokenizer) -> None:
    generation_config = GenerationConfig(max_new_tokens=12, eos_token_id=tokenizer.eos_token_id)
    manager = model.init_continuous_batching(generation_config=generation_config,
                                             continuous_batching_config=ContinuousBatchingConfig(**CB))  # fmt: skip
    manager.start()
    input_ids = tokenizer.encode(PROMPTS[2])
    manager.add_request(input_ids=input_ids, request_id="streamed", streaming=True)
    pieces = []
    for chunk in manager.request_id_iter(request_id="streamed"):
        pieces.append(chunk.generated_tokens[-1])
        if chunk.status == RequestStatus.FINISHED:
            break
    assert pieces == generate(model, input_ids, generation_config)
    manager.add_request(input_ids=input_ids, request_id="my_request")
    result = manager.get_result(request_id="my_request", timeout=60)
    assert result.generated_tokens == pieces
    manager.add_requests(inputs=[tokenizer.encode(p) for p in PROMPTS])
    assert [manager.get_result(timeout=60).is_finished() for _ in PROMPTS] == [True] * 3
    manager.stop()
    manager.start()  # another session on the same manager
    rid = manager.add_request(input_ids=input_ids, max_new_tokens=4)
    assert manager.get_result(rid, timeout=60).generated_tokens == pieces[:4]
    rid = manager.add_request(input_ids=input_ids, max_new_tokens=500, streaming=True)
    manager.stop(hard_stop=True)
    assert list(manager.request_id_iter(rid))[-1].finish_reason == "abort"
    manager.destroy()
    manager.destroy()  # safe twice
    with pytest.raises(RuntimeError, match="destroyed"):
        manager.start()


def test_guide_per_request_sampling_parameters(model, tokenizer) -> None:
    cb_config = ContinuousBatchingConfig(per_request_processors=True, **CB)
    with model.continuous_batching_context_manager(continuous_batching_config=cb_config) as manager:
        a = manager.add_request(input_ids=tokenizer.encode(PROMPTS[0]), temperature=0.9, top_p=0.95, seed=1,
                                max_new_tokens=8)  # fmt: skip
        b = manager.add_request(input_ids=tokenizer.encode(PROMPTS[1]), temperature=0.1, top_k=1, max_new_tokens=8)
        out_a, out_b = manager.get_result(a, timeout=60), manager.get_result(b, timeout=60)
    assert len(out_a.generated_tokens) >= 1
    assert out_b.generated_tokens == generate(model, tokenizer.encode(PROMPTS[1]), max_new_tokens=8)[
        : len(out_b.generated_tokens)]  # fmt: skip  (top_k=1 is greedy)


# -- every field and argument of transformers' API ------------------------------------------------
def test_every_field_of_transformers_config_is_accepted(caplog) -> None:
    """Walks transformers' ContinuousBatchingConfig: each field takes transformers' default; the ones
    cbserve cannot honour say so once when set to something else."""
    from transformers.generation import ContinuousBatchingConfig as TransformersConfig

    from engine import config as config_module

    for field in dataclasses.fields(TransformersConfig):
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        if field.name in ("use_default_compile_configs", "max_cached_graphs") and default is None:
            ContinuousBatchingConfig(**{field.name: default})  # deprecated: warns only when set
            continue
        ContinuousBatchingConfig(**{field.name: default})
    config_module._warned.clear()
    with caplog.at_level(logging.WARNING, logger="cbserve.engine"):
        for _ in range(2):
            ContinuousBatchingConfig(auto_switch_to_flash=False, cpu_group_timeout=None, disable_nccl_graph_mixing=False)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all("has no effect" in line for line in said)  # once each, with the reason
    assert not any("cpu_group_timeout" in line for line in said)  # tensor parallel's all-reduce timeout
    levels = ContinuousBatchingConfig(default_compile_level=2)
    assert levels.decode_compile_config.mode == "max-autotune-no-cudagraphs" and levels.decode_compile_config.dynamic
    with pytest.warns(FutureWarning, match="default_compile_level"):
        assert ContinuousBatchingConfig(use_default_compile_configs=True).default_compile_level == 3
    with pytest.raises(ValueError, match="safety_margin"):
        ContinuousBatchingConfig(safety_margin=1.5)


def test_every_argument_of_transformers_methods_is_accepted(model) -> None:
    for theirs, ours in method_pairs(model):
        accepted = inspect.signature(ours).parameters
        for name, param in inspect.signature(theirs).parameters.items():
            if param.kind is param.VAR_KEYWORD or name == "self":
                continue
            assert name in accepted or any(p.kind is p.VAR_KEYWORD for p in accepted.values()), (theirs, name)


def method_pairs(model) -> list[tuple]:
    """(transformers' method, cbserve's) for the public continuous-batching API."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager as TM
    from transformers.generation.continuous_batching.continuous_api import ContinuousMixin

    from engine import ContinuousBatchingManager

    pairs = [(ContinuousMixin.generate_batch, model.generate_batch),
             (ContinuousMixin.init_continuous_batching, model.init_continuous_batching),
             (ContinuousMixin.continuous_batching_context_manager, model.continuous_batching_context_manager)]  # fmt: skip
    names = ("__init__", "add_request", "add_requests", "cancel_request", "get_result", "request_id_iter", "start",
             "stop", "join", "warmup", "destroy", "pause", "register_result_handler", "is_running",
             "switch_to_cb_friendly_attn")  # fmt: skip
    # every one the installed transformers has (pause is newer than 5.17)
    return pairs + [(getattr(TM, name), getattr(ContinuousBatchingManager, name)) for name in names if hasattr(TM, name)]


def test_positional_parameters_are_transformers_in_its_order(model) -> None:
    """A positional call means what it means in transformers: its positional parameters lead ours, in
    its order (cbserve's own come after, keyword-only or last)."""

    def positional(f) -> list[str]:
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        return [n for n, p in inspect.signature(f).parameters.items() if p.kind in kinds and n != "self"]

    for theirs, ours in method_pairs(model):
        assert positional(ours)[: len(positional(theirs))] == positional(theirs), theirs.__qualname__


def test_stop_called_positionally_keeps_the_manager_as_transformers_does(model) -> None:
    manager = model.init_continuous_batching(continuous_batching_config=ContinuousBatchingConfig(**CB))
    manager.start()
    rid = manager.add_request([5, 6, 7], max_new_tokens=4, ignore_eos=True)
    manager.stop(True, 60, True)  # block, timeout, keep_for_next_session: a soft stop that keeps it
    assert manager.get_result(rid, timeout=60).generated_tokens == generate(model, [5, 6, 7], max_new_tokens=4)
    assert model.init_continuous_batching() is manager
    manager.start()
    rid = manager.add_request([5, 6, 7], max_new_tokens=50, ignore_eos=True)
    manager.stop(True, 60, False, True)  # ..., hard_stop: the request is aborted, not run to its end
    out = manager.get_result(rid, timeout=60)
    assert out is not None and out.finish_reason == "abort" and len(out.generated_tokens) < 50
    manager.destroy()


def test_request_status_is_transformers_enum() -> None:
    """Same names, same values, same comparisons: transformers 5.2x's RequestStatus is an IntEnum."""
    from transformers.generation.continuous_batching import RequestStatus as TransformersStatus

    assert [(s.name, s.value) for s in RequestStatus] == [(s.name, s.value) for s in TransformersStatus]
    assert issubclass(RequestStatus, int) == issubclass(TransformersStatus, int)
    for ours, theirs in zip(RequestStatus, TransformersStatus):
        assert ours == theirs.value and (ours >= RequestStatus.FINISHED) == (theirs >= TransformersStatus.FINISHED)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, "hot"], ids=["nan", "inf", "negative", "text"])
def test_a_temperature_the_server_refuses_fails_the_request_even_when_greedy(model, bad) -> None:
    """The server's rule (a finite number >= 0) holds for generate_batch and add_request too, also
    where greedy decoding would not use the temperature (do_sample=False)."""
    config = GenerationConfig(max_new_tokens=3, eos_token_id=None)
    cb = ContinuousBatchingConfig(**CB)
    for sampling in ({}, {"do_sample": False}, {"do_sample": True}):
        (out,) = model.generate_batch([[5, 6, 7]], generation_config=config, continuous_batching_config=cb,
                                      persistent_manager=True, temperature=bad, **sampling).values()  # fmt: skip
        assert out.status == RequestStatus.FAILED and "temperature must be" in out.error, (sampling, out.error)
    manager = model.init_continuous_batching()
    with pytest.raises(ValueError, match="temperature must be"):
        manager.add_request([5, 6, 7], max_new_tokens=3, temperature=bad, do_sample=False)
    model.destroy_cached_continuous_batching_manager()


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_switch_to_cb_friendly_attn_leaves_the_model_as_loaded(implementation) -> None:
    """transformers switches the model to an implementation its continuous batching runs; cbserve's
    engine runs over any, so the switch changes nothing and generation stays model.generate's."""
    model = use_cbserve(build_test_model("llama", vocab_size=VOCAB, attn_implementation=implementation))
    manager = model.init_continuous_batching(continuous_batching_config=ContinuousBatchingConfig(**CB))
    for auto_switch_to_flash in (True, False):
        assert manager.switch_to_cb_friendly_attn(model, auto_switch_to_flash) is None
        assert model.config._attn_implementation == implementation
    manager.start()
    rid = manager.add_request([5, 6, 7, 8], max_new_tokens=6, ignore_eos=True)
    assert manager.get_result(rid, timeout=60).generated_tokens == generate(model, [5, 6, 7, 8], max_new_tokens=6)
    manager.stop()
    assert model.config._attn_implementation == implementation


def test_the_safety_margin_holds_new_requests_back_while_others_run() -> None:
    from engine import LLMEngine

    # (waves off: as a wave the two would go shortest first, the short one ahead of the long one)
    config = ContinuousBatchingConfig(block_size=16, num_blocks=16, safety_margin=0.6, prefill_waves=False)
    engine = LLMEngine(build_test_model("llama", vocab_size=VOCAB), config)
    first = engine.make_request(list(range(5, 120)), max_new_tokens=4, ignore_eos=True)  # 8 of 16 blocks
    second = engine.make_request([5, 6, 7], max_new_tokens=4, ignore_eos=True)
    engine.add_request(first)
    engine.add_request(second)
    engine.step()
    assert second.status == RequestStatus.PENDING  # 8 free < 0.6 x 16 blocks once the first runs
    while engine.has_unfinished():
        engine.step()
    assert first.num_generated == second.num_generated == 4


# -- persistent managers and RL loops -------------------------------------------------------------
def test_a_persistent_generate_batch_loop_builds_and_profiles_once(model, monkeypatch) -> None:
    """Generate, optimizer step in place, generate: one engine build, one profiling forward, and each
    round equals model.generate with the weights of that round."""
    from engine import LLMEngine
    from engine.backends import executor as executor_module

    counts = {"build": 0, "profile": 0}
    build, profile = LLMEngine.__init__, executor_module.profile_activation_peak

    def counting_build(self, *args, **kwargs):
        counts["build"] += 1
        build(self, *args, **kwargs)

    def counting_profile(*args, **kwargs):
        counts["profile"] += 1
        return profile(*args, **kwargs)

    monkeypatch.setattr(LLMEngine, "__init__", counting_build)
    monkeypatch.setattr(executor_module, "profile_activation_peak", counting_profile)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    cfg = ContinuousBatchingConfig(block_size=16, max_batch_tokens=64, max_memory_percent=0.05)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(3):
        model.train()  # the trainer's mode: the engine runs eval forwards and leaves it as it was
        out = model.generate_batch(prompts, generation_config=GenerationConfig(max_new_tokens=6, eos_token_id=None),
                                   continuous_batching_config=cfg, persistent_manager=True)  # fmt: skip
        assert model.training and all(m.training for m in model.modules())
        model.eval()
        for p, o in zip(prompts, out.values()):
            assert o.generated_tokens == generate(model, p, max_new_tokens=6, eos_token_id=None)
        loss = model(torch.tensor([prompts[0]]), labels=torch.tensor([prompts[0]])).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # in place: the kept engine notices and drops its stale prefix cache
    assert counts == {"build": 1, "profile": 1}
    model.destroy_cached_continuous_batching_manager()
    assert not hasattr(model, "_cached_continuous_batching_manager")


def test_keep_for_next_session_hands_the_manager_back(model) -> None:
    manager = model.init_continuous_batching(continuous_batching_config=ContinuousBatchingConfig(**CB))
    manager.start()
    manager.stop(keep_for_next_session=True)
    assert model.init_continuous_batching() is manager  # the kept one, as transformers does
    engine = manager.engine
    with model.continuous_batching_context_manager(persistent_manager=True) as again:
        rid = again.add_request([5, 6, 7], max_new_tokens=4, ignore_eos=True)
        assert again.get_result(rid, timeout=60).generated_tokens == generate(model, [5, 6, 7], max_new_tokens=4)
    assert again is manager and manager.engine is engine  # cache kept across sessions
    other = model.init_continuous_batching(continuous_batching_config=ContinuousBatchingConfig(block_size=16, num_blocks=64))
    assert other is not manager  # asked for another config: built anew, the kept one destroyed
    with pytest.raises(RuntimeError, match="destroyed"):
        manager.start()


@pytest.mark.parametrize("async_batching", [False, True], ids=["one-step-at-a-time", "async-batching"])
def test_pause_lets_a_trainer_use_the_model_between_steps(model, async_batching) -> None:
    """Inside pause() the loop is parked: the trainer updates weights in place and may call
    model.generate itself (outside it, the engine's forwards and model.generate must not overlap). With
    async batching no step is left in flight while parked."""
    manager = model.init_continuous_batching(
        continuous_batching_config=ContinuousBatchingConfig(**CB, use_async_batching=async_batching))
    with pytest.raises(RuntimeError, match="running"):
        with manager.pause():
            pass
    manager.start()
    long_running = manager.add_request([5, 6, 7], max_new_tokens=400, ignore_eos=True, streaming=True)
    assert manager.get_result(long_running, timeout=60) is not None
    with manager.pause():
        assert not manager.engine.has_unfinished() or manager.engine.settle() == []  # nothing in flight
        before = manager.engine.generation_tokens_total
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9)
        expected = generate(model, [8, 9, 10, 11], max_new_tokens=6)
        assert manager.engine.generation_tokens_total == before  # no step ran meanwhile
    rid = manager.add_request([8, 9, 10, 11], max_new_tokens=6, ignore_eos=True)
    assert manager.get_result(rid, timeout=60).generated_tokens == expected
    final = list(manager.request_id_iter(long_running))[-1]
    assert final.is_finished() and len(final.generated_tokens) == 400  # nothing lost across the pause
    with manager.pause(), torch.no_grad():  # new tensors, not in place: the manager's own reset
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight = torch.nn.Parameter(module.weight * 1.1)
        expected = generate(model, [8, 9, 10, 11], max_new_tokens=6)
    manager.reset_prefix_cache()
    rid = manager.add_request([8, 9, 10, 11], max_new_tokens=6, ignore_eos=True)
    assert manager.get_result(rid, timeout=60).generated_tokens == expected
    manager.destroy()


# -- generation_config, read as model.generate reads it ----------------------------------------
def run_batch(model, prompts, config: GenerationConfig, **kwargs) -> list[list[int]]:
    out = model.generate_batch(prompts, generation_config=config, continuous_batching_config=ContinuousBatchingConfig(**CB),
                               **kwargs)  # fmt: skip
    return [o.generated_tokens for o in out.values()]


PROMPT = [5, 6, 7, 8, 9]


@pytest.mark.parametrize(
    "fields",
    [
        {"do_sample": False, "temperature": 0.7},  # greedy whatever the temperature
        {"do_sample": True, "top_k": 1, "temperature": 1.5},  # top_k honoured
        {"do_sample": True, "min_p": 1.0},  # min_p 1: only the most likely token survives
        {"do_sample": True, "top_p": 1e-6},  # top_p: only the most likely token survives
        {"repetition_penalty": 1.5},
        {"max_length": len(PROMPT) + 5},
    ],
)
def test_generation_config_fields_as_generate_reads_them(model, fields) -> None:
    config = GenerationConfig(max_new_tokens=None if "max_length" in fields else 10, eos_token_id=None, **fields)
    greedy = GenerationConfig(**{**config.to_diff_dict(), "do_sample": False})
    assert run_batch(model, [PROMPT], config) == [generate(model, PROMPT, greedy)]


def test_min_new_tokens_and_min_length_hold_eos_back(model) -> None:
    plain = generate(model, PROMPT, max_new_tokens=10, eos_token_id=None)
    eos = plain[1]  # greedy would end at the second token
    for fields in ({"min_new_tokens": 5}, {"min_length": len(PROMPT) + 5}):
        config = GenerationConfig(max_new_tokens=10, eos_token_id=eos, **fields)
        got = run_batch(model, [PROMPT], config)[0]
        assert got == generate(model, PROMPT, config)
        assert len(got) >= 5


def test_a_request_temperature_keeps_the_configs_top_k(model) -> None:
    config = GenerationConfig(max_new_tokens=10, eos_token_id=None, do_sample=True, top_k=1)
    assert run_batch(model, [PROMPT], config, temperature=2.0) == [generate(model, PROMPT, max_new_tokens=10)]


def test_num_return_sequences_reaches_the_manager(model) -> None:
    config = GenerationConfig(max_new_tokens=4, eos_token_id=None, num_return_sequences=3, do_sample=True)
    with model.continuous_batching_context_manager(generation_config=config,
                                                   continuous_batching_config=ContinuousBatchingConfig(**CB)) as manager:  # fmt: skip
        manager.add_request(PROMPT, request_id="r", seed=0)
        ids = sorted(result.request_id for result in manager)
    assert ids == ["r", "r__child#0", "r__child#1"]
    assert len(run_batch(model, [PROMPT, PROMPT], config)) == 6


def test_stop_strings_of_the_config_end_the_text(model, tokenizer) -> None:
    plain = generate(model, PROMPT, max_new_tokens=10, eos_token_id=None)
    stop = tokenizer.decode(plain[3:5])
    config = GenerationConfig(max_new_tokens=10, eos_token_id=None, stop_strings=stop)
    out = model.generate_batch([PROMPT], generation_config=config, tokenizer=tokenizer,
                               continuous_batching_config=ContinuousBatchingConfig(**CB))  # fmt: skip
    assert len(out["req_0"].generated_tokens) <= 5 and out["req_0"].finish_reason == "stop"


def test_unsupported_generation_fields_are_named(model, caplog) -> None:
    config = GenerationConfig(max_new_tokens=4, num_beams=2, no_repeat_ngram_size=3)
    with caplog.at_level(logging.WARNING, logger="cbserve.engine"):
        run_batch(model, [PROMPT], config)
    assert any("no_repeat_ngram_size=3" in r.getMessage() and "num_beams=2" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="num_beams=2.*drop_unsupported_processors"):
        model.generate_batch([PROMPT], generation_config=config, continuous_batching_config=ContinuousBatchingConfig(
            drop_unsupported_processors=False, **CB))  # fmt: skip


def test_processed_logprobs_are_those_of_the_distribution_drawn_from() -> None:
    """logprobs_mode "processed_logprobs" (what transformers returns): after temperature and top-k the
    logprobs sum to 1 over the top-k tokens; "raw_logprobs" (the default) are the model's own."""
    from engine import LLMEngine

    model = build_test_model("llama", vocab_size=VOCAB)
    with torch.no_grad():
        raw = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, -1].float(), dim=-1)
    for mode in ("raw_logprobs", "processed_logprobs"):
        engine = LLMEngine(model, ContinuousBatchingConfig(logprobs_mode=mode, **CB))
        req = engine.make_request(PROMPT, max_new_tokens=1, temperature=0.5, top_k=3, seed=0, logprobs=5)
        engine.add_request(req)
        while engine.has_unfinished():
            engine.step()
        top = req.top_logprobs[0]
        if mode == "raw_logprobs":
            assert all(abs(v - raw[t].item()) < 1e-5 for t, v in top.items())
        else:
            finite = {t: v for t, v in top.items() if v > float("-inf")}
            assert set(finite) == set(raw.topk(3).indices.tolist())
            assert abs(sum(torch.tensor(list(finite.values())).exp()).item() - 1) < 1e-5
            expected = torch.log_softmax(raw[list(finite)] / 0.5, dim=-1)
            assert torch.allclose(torch.tensor(list(finite.values())), expected, atol=1e-5)
    with pytest.raises(ValueError, match="logprobs_mode"):
        ContinuousBatchingConfig(logprobs_mode="processed")
