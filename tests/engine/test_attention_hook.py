"""cbserve's attention is registered with transformers once: the model keeps working with its own
attention outside engine steps, on any thread, even while the engine runs."""

from __future__ import annotations

import threading

import pytest
import torch

from engine import ContinuousBatchingConfig, ContinuousBatchingManager, LLMEngine, generate_batch
from engine.attention import ATTN_IMPLEMENTATION, installed
from engine.testing import build_test_model

CFG = ContinuousBatchingConfig(block_size=16, num_blocks=128)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]  # different lengths: generate pads (left) and masks


def padded_generate(model) -> list[list[int]]:
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0)  # fmt: skip
    return out[:, width:].tolist()


@pytest.mark.parametrize("own", ["sdpa", "eager"])
def test_generate_after_the_engine_ran_uses_the_models_own_attention(own) -> None:
    model = build_test_model("llama", attn_implementation=own)
    before = padded_generate(model)
    engine = LLMEngine(model, CFG)
    engine.add_request(engine.make_request(PROMPTS[0], max_new_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert model.config._attn_implementation == own  # between steps, the model is as it was
    assert padded_generate(model) == before  # the mask and the attention of `own`, token for token
    req = engine.make_request(PROMPTS[1], max_new_tokens=4, ignore_eos=True)
    engine.add_request(req)
    while engine.has_unfinished():
        engine.step()
    assert list(req.generated_ids) == padded_generate_one(model, PROMPTS[1], 4)


def padded_generate_one(model, prompt, n) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_generate_on_another_thread_while_the_engine_steps() -> None:
    model = build_test_model("llama")
    before = padded_generate(model)
    long = 400
    mgr = ContinuousBatchingManager(model, continuous_batching_config=CFG)
    mgr.start()
    try:
        rid = mgr.add_request(PROMPTS[0], max_new_tokens=long, ignore_eos=True, streaming=True)
        stream = mgr.request_id_iter(rid)
        first = next(stream)  # the engine thread is generating now
        assert len(first.generated_tokens) < long
        results, errors = [], []

        def run() -> None:
            try:
                results.append(padded_generate(model))
            except Exception as exc:  # noqa: BLE001  (reported below)
                errors.append(exc)

        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert errors == [] and results == [before, before]
        out = first
        for out in stream:  # to the end of the engine's request
            pass
        assert out.error is None and len(out.generated_tokens) == long
        assert out.generated_tokens[:12] == padded_generate_one(model, PROMPTS[0], 12)
    finally:
        mgr.stop(block=True, timeout=30)


def test_cbserves_implementation_is_set_inside_steps_only_and_overlapping_steps_nest() -> None:
    model = build_test_model("llama", attn_implementation="sdpa")
    wrapped = f"{ATTN_IMPLEMENTATION}+sdpa"
    with installed(model):
        with installed(model):  # a second engine's step on the same model
            assert model.config._attn_implementation == wrapped
        assert model.config._attn_implementation == wrapped  # the first step still runs
    assert model.config._attn_implementation == "sdpa"
    model.config._attn_implementation = wrapped  # left by hand (or by an older cbserve): unwrapped after a step
    with installed(model):
        assert model.config._attn_implementation == wrapped
    assert model.config._attn_implementation == "sdpa"


def test_transformers_own_continuous_batching_runs_on_the_model_after_cbserves() -> None:
    """Found running benchmarks/throughput.py's peers on one model: transformers' `generate_batch`
    refuses attention implementations it does not know, so cbserve leaves none behind."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig as HFConfig

    model = build_test_model("llama", attn_implementation="sdpa")
    ours = generate_batch(model, PROMPTS, max_new_tokens=6, ignore_eos=True)
    gen = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
    theirs = model.generate_batch(PROMPTS, generation_config=gen, progress_bar=False,
                                  continuous_batching_config=HFConfig(page_size=16, num_blocks=64, max_batch_tokens=64))
    assert [o.generated_tokens for o in theirs.values()] == [o.generated_tokens for o in ours.values()]
