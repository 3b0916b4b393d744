"""Prefix caching: same outputs as without it, real hits, one-block-at-a-time LRU eviction."""

from __future__ import annotations

import torch

from engine import ContinuousBatchingConfig, LLMEngine, generate_batch
from engine.block_manager import BlockManager
from engine.request import Request, SamplingParams
from tests.engine.conftest import VOCAB, model_for, reference


def shared_prefix_prompts(n: int, prefix_len: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(4, VOCAB, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(4, VOCAB, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def run(prompts, sharing: bool, **cfg):
    engine = LLMEngine(model_for("llama"), ContinuousBatchingConfig(block_size=16, num_blocks=1024,
                                                                    allow_block_sharing=sharing, **cfg))
    reqs = [engine.make_request(p, max_new_tokens=12, ignore_eos=True) for p in prompts]
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    return [r.generated_ids for r in reqs], engine


def test_outputs_with_and_without_prefix_caching_are_identical_and_exact() -> None:
    prompts = shared_prefix_prompts(32, 200)
    on, engine = run(prompts, sharing=True)
    off, _ = run(prompts, sharing=False)
    assert on == off
    for p, got in list(zip(prompts, on))[:6]:
        assert tuple(got) == reference("llama", tuple(p), 12)
    stats = engine.stats()
    shared_tokens = 32 * 200
    assert stats["prefix_cache_hits_total"] / shared_tokens > 0.8
    assert stats["prefix_cache_queries_total"] == sum(len(p) for p in prompts)
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_hits_across_steps_and_under_chunked_prefill() -> None:
    prompts = shared_prefix_prompts(8, 100, seed=1)
    on, engine = run(prompts, sharing=True, max_batch_tokens=48)
    off, _ = run(prompts, sharing=False, max_batch_tokens=48)
    assert on == off
    assert engine.stats()["prefix_cache_hits_total"] >= 7 * 96


def test_second_wave_hits_blocks_left_by_finished_requests() -> None:
    prompts = shared_prefix_prompts(4, 64, seed=2)
    engine = LLMEngine(model_for("qwen3"), ContinuousBatchingConfig(block_size=16, num_blocks=256))
    first = engine.make_request(prompts[0], max_new_tokens=4, ignore_eos=True)
    engine.add_request(first)
    while engine.has_unfinished():
        engine.step()
    second = engine.make_request(prompts[1], max_new_tokens=4, ignore_eos=True)
    engine.add_request(second)
    engine.step()
    assert second.num_cached_tokens == 64
    while engine.has_unfinished():
        engine.step()
    assert tuple(second.generated_ids) == reference("qwen3", tuple(prompts[1]), 4)


def _req(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, tokens, 4, SamplingParams(), frozenset())


def test_lru_evicts_one_block_at_a_time_and_last_token_is_recomputed() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = _req(list(range(10, 19)))  # 9 tokens: 2 full blocks + 1 token
    bm.grow(a, 9)
    bm.register_full_blocks(a, 9)
    a.num_computed = 9
    bm.release(a)
    assert bm.num_free == 4 and len(bm.hash_to_block) == 2
    # the uncached block is reused first; the cached ones survive
    b = _req([1, 2, 3], "b")
    bm.grow(b, 3)
    assert len(bm.hash_to_block) == 2
    # a request needing 2 more blocks evicts exactly one cached block (the LRU one)
    c = _req([5, 6, 7, 8, 9, 10, 11, 12], "c")
    bm.grow(c, 8)
    assert len(bm.hash_to_block) == 1
    # the survivor is a's first block (the chain's head outlives its tail)
    d = _req(list(range(10, 18)), "d")
    assert bm.match_prefix(d) == 4
    # a prompt of exactly one cached block reuses nothing: its last token is always recomputed
    e = _req(list(range(10, 14)), "e")
    assert bm.match_prefix(e) == 0


def test_refcounts_shared_blocks_are_freed_once() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _req(list(range(20, 33)))
    bm.grow(a, 13)
    bm.register_full_blocks(a, 13)
    b = _req(list(range(20, 33)) + [99], "b")
    assert bm.match_prefix(b) == 12
    assert bm.ref_count[a.block_ids[0]] == 2
    bm.release(a)
    assert bm.num_free == 8 - 3  # b still holds the three shared blocks
    bm.release(b)
    assert bm.num_free == 8


def test_decode_tokens_attend_over_shared_blocks_together_with_exact_outputs(arch) -> None:
    """Sequences whose cached prompts share blocks take the kernel's cascade pass in decode steps
    (the shared blocks once for all of them, merged by log-sum-exp): greedy outputs stay equal to
    model.generate, and to the same engine with the pass off."""
    prompts = shared_prefix_prompts(8, 40, seed=3)  # 8 decoders over 2 shared blocks of 16
    outputs = {}
    for min_seqs in (4, 0):
        engine = LLMEngine(model_for(arch), ContinuousBatchingConfig(block_size=16, num_blocks=256))
        engine.backend.cascade_min_seqs = min_seqs
        reqs = [engine.make_request(p, max_new_tokens=12, ignore_eos=True) for p in prompts]
        for r in reqs:
            engine.add_request(r)
        while engine.has_unfinished():
            engine.step()
        outputs[min_seqs] = [tuple(r.generated_ids) for r in reqs]
    assert outputs[4] == outputs[0]
    assert outputs[4] == [reference(arch, tuple(p), 12) for p in prompts]
