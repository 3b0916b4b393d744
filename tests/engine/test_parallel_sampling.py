"""n > 1: siblings share the prompt's blocks (copy-on-write of the partial one), own seed streams."""

from __future__ import annotations

from engine import ContinuousBatchingConfig, LLMEngine, generate_batch
from tests.engine.conftest import model_for, prompts_for, reference

PROMPT = list(prompts_for()[0])[:40] + list(range(4, 4 + max(0, 40 - len(prompts_for()[0]))))  # 40 tokens


def peak_blocks(requests: list[dict], **cfg) -> tuple[int, list, LLMEngine]:
    engine = LLMEngine(model_for("llama"), ContinuousBatchingConfig(block_size=16, num_blocks=128, **cfg))
    reqs = [engine.make_request(PROMPT, max_new_tokens=6, ignore_eos=True, **r) for r in requests]
    for r in reqs:
        engine.add_request(r)
    peak, finished = 0, []
    while engine.has_unfinished():
        finished += [r for r in engine.step() if r.is_finished]
        peak = max(peak, engine.block_manager.num_blocks - engine.block_manager.num_free)
    return peak, finished, engine


def test_n4_equals_four_requests_seeded_s_to_s_plus_3() -> None:
    cfg = ContinuousBatchingConfig(block_size=16, num_blocks=128)
    together = generate_batch(model_for("llama"), [PROMPT], num_return_sequences=4, temperature=1.0, seed=7,
                              max_new_tokens=10, ignore_eos=True, progress_bar=False, continuous_batching_config=cfg)
    assert list(together) == ["req_0", "req_0__child#0", "req_0__child#1", "req_0__child#2"]
    apart = [generate_batch(model_for("llama"), [PROMPT], temperature=1.0, seed=7 + i, max_new_tokens=10,
                            ignore_eos=True, progress_bar=False, continuous_batching_config=cfg)["req_0"]
             for i in range(4)]
    assert [o.generated_tokens for o in together.values()] == [o.generated_tokens for o in apart]
    assert len({tuple(o.generated_tokens) for o in together.values()}) > 1  # the streams differ


def test_n4_greedy_siblings_are_exact() -> None:
    out = generate_batch(model_for("llama"), [PROMPT], num_return_sequences=4, max_new_tokens=24, ignore_eos=True,
                         progress_bar=False, continuous_batching_config=ContinuousBatchingConfig(block_size=16, num_blocks=64))
    assert all(tuple(o.generated_tokens) == reference("llama", tuple(PROMPT)) for o in out.values())


def test_n4_uses_fewer_blocks_than_four_separate_requests_and_copies_on_write() -> None:
    forked_peak, forked, engine = peak_blocks([dict(num_return_sequences=4)], allow_block_sharing=False)
    separate_peak, separate, _ = peak_blocks([{}] * 4, allow_block_sharing=False)
    assert len(forked) == len(separate) == 4
    assert sorted(r.generated_ids for r in forked) == sorted(r.generated_ids for r in separate)
    # 40 tokens + 6 new = 3 blocks of 16 per sequence: separately 4 x 3 = 12; forked, the two full
    # prompt blocks are shared and only the partial block is copied per sibling: 2 + 4 = 6
    assert separate_peak == 12
    assert forked_peak == 6
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


def test_bad_n_is_refused() -> None:
    import pytest

    engine = LLMEngine(model_for("llama"), ContinuousBatchingConfig(block_size=16, num_blocks=16))
    with pytest.raises(ValueError, match="num_return_sequences"):
        engine.make_request([1, 2, 3], max_new_tokens=4, num_return_sequences=0)
    with pytest.raises(ValueError, match=r"num_return_sequences \(n\) is 5, more sequences than run at once"):
        LLMEngine(model_for("llama"), ContinuousBatchingConfig(block_size=16, num_blocks=16, max_requests_per_batch=4)
                  ).make_request([1, 2, 3], max_new_tokens=4, num_return_sequences=5)


def test_siblings_count_against_the_request_cap() -> None:
    """n > 1 requests are admitted only where their siblings fit under max_requests_per_batch: a step
    never runs more sequences than the cap (the graphs' largest bucket, the sampler's planned rows)."""
    engine = LLMEngine(model_for("llama"), ContinuousBatchingConfig(block_size=16, num_blocks=128,
                                                                    max_requests_per_batch=4))  # fmt: skip
    reqs = [engine.make_request(list(p)[:20], max_new_tokens=8, ignore_eos=True, num_return_sequences=n)
            for p, n in zip(prompts_for(), (3, 2, 1, 4))]
    for r in reqs:
        engine.add_request(r)
    done = []
    while engine.has_unfinished():
        done += [r for r in engine.step() if r.is_finished]
        assert len(engine.scheduler.running) <= 4
    assert len(done) == 3 + 2 + 1 + 4
