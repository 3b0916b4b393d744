"""Greedy output is token-identical to model.generate, whatever the batching does."""

from __future__ import annotations

import pytest

from engine import ContinuousBatchingConfig, generate_batch
from tests.engine.conftest import MAX_NEW, model_for, prompts_for, reference

SETTINGS = {
    # name: (config, what it forces)
    "large-budget-bs16": dict(block_size=16, num_blocks=512, max_batch_tokens=4096),
    "large-budget-bs256": dict(block_size=256, num_blocks=32, max_batch_tokens=4096),
    "chunked-prefill": dict(block_size=16, num_blocks=512, max_batch_tokens=40),
    "preemption": dict(block_size=16, num_blocks=16, max_batch_tokens=256),
    "prefill-first": dict(block_size=16, num_blocks=512, max_batch_tokens=64, scheduler_type="prefill_first"),
    "prefill-first-preemption": dict(block_size=16, num_blocks=16, max_batch_tokens=48, scheduler_type="prefill_first"),
    "no-prefix-cache-bs256-chunked": dict(block_size=256, num_blocks=8, max_batch_tokens=100, allow_block_sharing=False),
    # max_decode_stall 1: with decodes running, one block of prompt a step (16 tokens, chunks of any length up to it)
    "decode-stall-min-chunks": dict(block_size=16, num_blocks=512, max_batch_tokens=256, max_decode_stall=1.0),
    "decode-stall-preemption": dict(block_size=16, num_blocks=16, max_batch_tokens=256, max_decode_stall=1.0),
    "decode-stall-off": dict(block_size=16, num_blocks=512, max_batch_tokens=256, max_decode_stall=0.0),
    # prefill waves: the prompts all arrive together, so they go as one wave, shortest first
    "prefill-waves": dict(block_size=16, num_blocks=512, max_batch_tokens=64, max_decode_stall=4.0, prefill_waves=True),
    # async batching: decodes scheduled ahead of the last step's tokens, fed them on the device
    "async-batching": dict(block_size=16, num_blocks=512, max_batch_tokens=64, use_async_batching=True),
    "async-batching-preemption": dict(block_size=16, num_blocks=16, max_batch_tokens=256, use_async_batching=True),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_model_generate(arch: str, setting: str) -> None:
    prompts = [list(p) for p in prompts_for()]
    model = model_for(arch)
    cfg = ContinuousBatchingConfig(**SETTINGS[setting])
    out = generate_batch(model, prompts, continuous_batching_config=cfg, max_new_tokens=MAX_NEW, ignore_eos=True,
                         progress_bar=False)
    assert list(out) == [f"req_{i}" for i in range(len(prompts))]
    for i, prompt in enumerate(prompts):
        got = out[f"req_{i}"]
        assert got.error is None
        assert got.finish_reason == "length"
        assert tuple(got.generated_tokens) == reference(arch, tuple(prompt)), f"{setting}: prompt {i} differs"


def test_preemption_really_happens() -> None:
    """The 'preemption' setting above does preempt (else it would prove nothing)."""
    from engine import LLMEngine

    engine = LLMEngine(model_for("llama"), ContinuousBatchingConfig(**SETTINGS["preemption"]))
    for p in prompts_for():
        engine.add_request(engine.make_request(list(p), max_new_tokens=MAX_NEW, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


def test_chunked_prefill_really_chunks() -> None:
    from engine import LLMEngine

    engine = LLMEngine(model_for("llama"), ContinuousBatchingConfig(**SETTINGS["chunked-prefill"]))
    long_prompt = max(prompts_for(), key=len)
    assert len(long_prompt) > 40
    req = engine.make_request(list(long_prompt), max_new_tokens=2, ignore_eos=True)
    engine.add_request(req)
    engine.step()
    assert 0 < req.num_computed < len(long_prompt)
    assert req.num_generated == 0


def test_model_generate_batch_opt_in() -> None:
    from engine import use_cbserve

    model = use_cbserve(model_for("qwen2"))
    prompts = [list(p) for p in prompts_for()[:4]]
    out = model.generate_batch(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, progress_bar=False,
                               continuous_batching_config=ContinuousBatchingConfig(block_size=16, num_blocks=64))
    assert [tuple(o.generated_tokens) for o in out.values()] == [reference("qwen2", tuple(p)) for p in prompts]


def test_the_decode_stall_cap_really_caps() -> None:
    """The 'decode-stall-min-chunks' setting does hold prompts to one block a step while decodes run."""
    from engine import LLMEngine

    engine = LLMEngine(model_for("llama"), ContinuousBatchingConfig(**SETTINGS["decode-stall-min-chunks"]))
    prompts = sorted(prompts_for(), key=len)
    engine.add_request(engine.make_request(list(prompts[0]), max_new_tokens=MAX_NEW, ignore_eos=True))
    engine.step()  # prefilled alone, whole: now it decodes
    long = engine.make_request(list(prompts[-1]), max_new_tokens=2, ignore_eos=True)
    engine.add_request(long)
    engine.step()
    assert long.num_computed == 16 < len(prompts[-1])
    assert engine.stats()["prefill_token_cap"] == 16
