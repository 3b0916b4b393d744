"""Preemption by recompute and by swap to host memory: exact outputs, blocks really move."""

from __future__ import annotations

import pytest

from engine import ContinuousBatchingConfig, LLMEngine
from engine.kv_cache import PagedKVCache, kv_geometry
from engine.backends.memory import kv_bytes_per_block
from tests.engine.conftest import MAX_NEW, model_for, prompts_for, reference


def run(arch: str, **cfg):
    engine = LLMEngine(model_for(arch), ContinuousBatchingConfig(block_size=16, num_blocks=16, max_batch_tokens=256, **cfg))
    prompts = [list(p) for p in prompts_for()]
    reqs = [engine.make_request(p, max_new_tokens=MAX_NEW, ignore_eos=True) for p in prompts]
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    for p, r in zip(prompts, reqs):
        assert tuple(r.generated_ids) == reference(arch, tuple(p)), r.request_id
    return engine.stats()


def block_bytes(arch: str) -> int:
    layers, kv_heads, head_dim = kv_geometry(model_for(arch).config)
    return kv_bytes_per_block(layers, kv_heads, head_dim, 16, next(model_for(arch).parameters()).dtype)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_recompute_and_swap_both_match_model_generate(arch: str) -> None:
    recompute = run(arch)
    assert recompute["num_preemptions_total"] > 0 and recompute["swap_out_blocks_total"] == 0
    swap = run(arch, cpu_offload_space=64 * block_bytes(arch) / (1 << 30))
    assert swap["num_preemptions_total"] > 0
    assert swap["swap_out_blocks_total"] > 0
    assert swap["swap_in_blocks_total"] == swap["swap_out_blocks_total"]  # all came back
    assert swap["num_free_blocks"] == swap["num_blocks"]


def test_full_pool_falls_back_to_recompute() -> None:
    stats = run("llama", cpu_offload_space=2 * block_bytes("llama") / (1 << 30))  # room for 2 blocks only
    assert stats["num_preemptions_total"] > 0
    assert stats["swap_out_blocks_total"] <= stats["num_preemptions_total"] * 2
    assert stats["swap_in_blocks_total"] == stats["swap_out_blocks_total"]


def test_swap_copies_block_contents_exactly() -> None:
    cache = PagedKVCache(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8, dtype=model_for("llama").dtype)
    for k in cache.k + cache.v:
        k.normal_()
    before = [(k[[1, 3]].clone(), v[[1, 3]].clone()) for k, v in zip(cache.k, cache.v)]
    saved = cache.copy_blocks_out([1, 3])
    cache.copy_blocks_in([4, 0], saved)
    for (k, v), (k0, v0) in zip(zip(cache.k, cache.v), before):
        assert k[[4, 0]].equal(k0) and v[[4, 0]].equal(v0)
