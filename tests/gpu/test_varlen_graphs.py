"""Varlen (prefill and mixed) graphs on the CPU: token buckets, keys, padding, capture on first use.

The step runs through `FlashAttnBackend` with torch references of flash-attn's two kernels (the
varlen graph path is flash-attn's), in bfloat16 with blocks of 256, replayed by the eager stand-in
for CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from engine.backends.cuda import FlashAttnBackend
from engine.kv_cache import PagedKVCache, kv_geometry
from engine.backends.step_dispatch import StepDispatcher
from engine.testing import build_test_model
from engine.backends.cuda.varlen_graphs import (
    VarlenBuffers,
    VarlenGraphRunner,
    VarlenKey,
    choose_varlen_graph,
    fill_varlen_buffers,
    varlen_token_sizes,
)
from tests.gpu.helpers import EagerCapturer, FlashReference, hf_forward, meta_for


@pytest.mark.parametrize(
    "budget, sizes", [(1024, [64, 128, 256, 512, 1024]), (100, [64, 100]), (64, [64]), (10, [10])]
)
def test_token_buckets(budget, sizes):
    assert varlen_token_sizes(budget) == sizes


def test_bad_token_budget():
    with pytest.raises(ValueError, match="max_batch_tokens"):
        varlen_token_sizes(0)


def test_keys():
    tokens, seqs = varlen_token_sizes(512), [1, 2, 4, 8, 9]
    three = meta_for([[1], [2], [3, 4]], [9, 30, 100], [1, 1, 68], 64)  # 70 tokens in 3 sequences
    assert choose_varlen_graph(three, 70, tokens, seqs, max_blocks_per_seq=8) == VarlenKey(128, 4)
    exact = meta_for([[1], [2]], [40, 24], [40, 24], 64)  # 64 tokens: no padding sequence needed
    assert choose_varlen_graph(exact, 64, tokens, seqs, max_blocks_per_seq=8) == VarlenKey(64, 2)
    assert choose_varlen_graph(three, 70, tokens, seqs, max_blocks_per_seq=1) is None  # table too wide
    narrow = meta_for([[1]], [5], [5], 16)  # 59 padding tokens would not fit one block
    assert choose_varlen_graph(narrow, 5, tokens, seqs, max_blocks_per_seq=1) is None
    assert choose_varlen_graph(narrow, 600, tokens, seqs, max_blocks_per_seq=8) is None  # over the budget
    full = meta_for([[i] for i in range(9)], [2] * 9, [2] * 9, 16)  # 9 sequences + padding: 10 > 9
    assert choose_varlen_graph(full, 18, tokens, seqs, max_blocks_per_seq=8) is None


def test_padding_forms_one_sequence_on_the_padding_block_and_empty_ones_after():
    buf = VarlenBuffers.allocate(128, 8, 4, "cpu")
    meta = meta_for([[1], [2, 3]], [9, 20], [1, 5], 16)  # 6 tokens
    key = VarlenKey(16, 4)
    fill_varlen_buffers(buf, key, torch.arange(100, 106), torch.tensor([8, 15, 16, 17, 18, 19]), meta, pad_block=9)
    assert buf.input_ids[:16].tolist() == list(range(100, 106)) + [0] * 10
    assert buf.positions[6:16].tolist() == list(range(10))
    assert buf.slot_mapping[6:16].tolist() == [9 * 16 + i for i in range(10)]
    assert buf.cu_seqlens_q[:5].tolist() == [0, 1, 6, 16, 16]
    assert buf.seq_lens_k[:4].tolist() == [9, 20, 10, 1]
    assert buf.block_tables[:4].tolist() == [[1, 0, 0, 0], [2, 3, 0, 0], [9, 9, 9, 9], [9, 9, 9, 9]]
    with pytest.raises(ValueError, match="does not fit"):
        fill_varlen_buffers(buf, VarlenKey(16, 2), torch.arange(6), torch.arange(6), meta, pad_block=9)


BS, NUM_BLOCKS = 256, 6


def test_mixed_steps_replay_their_graph_and_equal_the_eager_step():
    torch.manual_seed(0)
    model = build_test_model("llama", vocab_size=512).to(torch.bfloat16)
    layers, hkv, hd = kv_geometry(model.config)
    cache = PagedKVCache(layers, NUM_BLOCKS + 1, BS, hkv, hd, torch.bfloat16)
    ref = FlashReference()
    backend = FlashAttnBackend(ref.varlen, ref.kvcache)
    eager = hf_forward(model, backend, cache)
    dispatch = StepDispatcher(
        eager, graph_flags=(True, False), device="cpu", max_requests=4, max_batch_tokens=128,
        max_blocks_per_seq=2, block_size=BS, pad_block=NUM_BLOCKS, capturer=EagerCapturer(),
    )  # fmt: skip
    assert dispatch.reserved_blocks == 1 and dispatch.graphs is None
    with torch.inference_mode():
        dispatch.warmup()  # start-up: the whole grid, over the padding block only
    grid = {VarlenKey(t, n) for t in (128, 64) for n in (5, 4, 2, 1)}
    assert set(dispatch.varlen_graphs.graphs) == grid
    for t in cache.k + cache.v:
        assert not t[:NUM_BLOCKS].any(), "warm-up wrote outside the padding block"
        t[NUM_BLOCKS].zero_()

    tables = [[3], [0, 5], [2]]
    # step 1: prompts of 40 and 30 tokens: 70 tokens, 2 sequences + padding -> key (128, 4)
    # step 2: the first decodes, the second's prompt goes on (a chunk of 50), a new prompt of 9: 60 -> (64, 4)
    # step 3: two decode, the third's prompt goes on (21 more): 23 tokens -> (64, 4) again, replayed
    steps = [
        ([40, 30], [40, 30], tables[:2]),
        ([41, 80, 9], [1, 50, 9], tables),
        ([42, 81, 30], [1, 1, 21], tables),
    ]
    g = torch.Generator().manual_seed(1)
    for k_lens, q_lens, tbl in steps:
        meta = meta_for(tbl, k_lens, q_lens, BS)
        ids = torch.randint(4, 512, (sum(q_lens),), generator=g)
        pos = torch.cat([torch.arange(k - q, k) for k, q in zip(k_lens, q_lens)])
        rows = (meta.cu_seqlens_q[1:] - 1).long()[torch.tensor([0, len(k_lens) - 1])]  # the first and last sample
        before = [t.clone() for t in cache.k + cache.v]
        with torch.inference_mode():
            got = dispatch(ids, pos, meta, rows)
        after = [t.clone() for t in cache.k + cache.v]
        for t, b in zip(cache.k + cache.v, before):
            t.copy_(b)
        meta.extra.clear()
        with torch.inference_mode():
            expected = eager(ids, pos, meta, rows)
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
        for a, e in zip(after, cache.k + cache.v):
            assert torch.equal(a[:NUM_BLOCKS], e[:NUM_BLOCKS]), "the graph step wrote the cache differently"
        graph_k0 = after[0]  # layer 0 keys as the graph step left them
        assert not graph_k0[1].any() and not graph_k0[4].any(), "blocks of no request were written"
        assert graph_k0[NUM_BLOCKS].any(), "the padding tokens write into the padding block"
    assert dispatch.replays == 3
    assert set(dispatch.varlen_graphs.graphs) == grid  # nothing captured while serving
    assert {name for name, _ in ref.calls} == {"varlen"}


def test_warmup_captures_the_grid_largest_first_within_the_cap_and_steps_outside_it_run_eagerly():
    def runner(max_graphs: int) -> VarlenGraphRunner:
        return VarlenGraphRunner(
            lambda ids, pos, meta, rows: torch.zeros(len(rows), 4), max_batch_tokens=256, max_requests=4,
            max_blocks_per_seq=2, block_size=16, pad_block=9, device="cpu", capturer=EagerCapturer(),
            max_graphs=max_graphs,
        )  # fmt: skip

    whole, capped = runner(96), runner(3)
    with torch.inference_mode():
        whole.warmup()
        capped.warmup()
    # a sequence's table reaches 32 tokens (2 blocks of 16): 256 tokens would need 8 sequences, and
    # 128 at least 4; sequences never outnumber tokens
    assert list(whole.graphs) == [VarlenKey(128, 5), VarlenKey(128, 4), VarlenKey(64, 5), VarlenKey(64, 4),
                                  VarlenKey(64, 2)]  # fmt: skip
    assert list(capped.graphs) == list(whole.graphs)[:3]
    step = meta_for([[1, 2], [3, 4]], [30, 30], [30, 30], 16)  # 60 tokens, 2 sequences + padding: (64, 4)
    ids = torch.arange(60)
    with torch.inference_mode():
        assert whole.key_for(step, 60) == VarlenKey(64, 4)
        assert whole.run(ids, ids, step) is not None and whole.replays == 1
        assert capped.key_for(step, 60) is None  # left out at start-up: eagerly, not captured now
        assert capped.run(ids, ids, step) is None and len(capped.graphs) == 3 and capped.replays == 0


def test_graph_count_is_capped_then_steps_run_eagerly():
    runner = VarlenGraphRunner(
        lambda *a: None, max_batch_tokens=256, max_requests=4, max_blocks_per_seq=2, block_size=16,
        pad_block=9, device="cpu", capturer=EagerCapturer(), max_graphs=0,
    )  # fmt: skip
    meta = meta_for([[1]], [5], [5], 16)
    assert runner.key_for(meta, 5) is None
    assert runner.run(torch.arange(5), torch.arange(5), meta) is None
