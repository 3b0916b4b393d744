"""benchmarks/attention_kernel.py: its shapes are chosen by name, an unknown name is one clear error,
and a long-context shape's cache holds every sequence's blocks."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def bench(bench_script):
    return bench_script("attention_kernel")


def test_shapes_are_chosen_by_name_and_an_unknown_one_is_named(bench) -> None:
    assert list(bench.chosen(None)) == list(bench.shapes())
    assert list(bench.chosen("prefill W3, decode 16k")) == ["prefill W3", "decode 16k"]
    with pytest.raises(SystemExit, match=r"unknown shapes \['prefill 1M'\]; known: \["):
        bench.chosen("prefill W3,prefill 1M")


def test_a_long_context_step_gets_a_cache_large_enough_for_its_blocks(bench, monkeypatch) -> None:
    monkeypatch.setattr(bench, "BLOCK", 16)
    q, k_cache, _, tables, k_lens, q_start = bench.step(torch.float32, q_lens=[1] * 8, k_lens=[16384] * 8)
    assert k_cache.shape[0] >= 8 * 1024 + 64 and tables.shape == (8, 1024)
    assert len(set(tables.flatten().tolist())) == tables.numel()  # every block its own
    assert int(tables.max()) < k_cache.shape[0] and q.shape[0] == 8 and int(q_start[-1]) == 8
