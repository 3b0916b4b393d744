"""Decode CUDA graphs' logic on the CPU: the flag, buckets, graph keys, padding, capture and replay.

Capture/replay runs through an eager stand-in for torch.cuda.CUDAGraph: replay re-runs the captured
function over the persistent buffers, so a runner that forgot to refresh a buffer, or padded a row
onto a real request's blocks, gives wrong logits or a wrong cache here.
"""

from __future__ import annotations

import logging

import pytest
import torch

from engine.backends.cpu import SDPABackend
from engine.backends.cuda import SDPACudaBackend
from engine.backends.cuda.graphs import (
    DecodeBuffers,
    DecodeGraphRunner,
    bucket_for,
    choose_decode_graph,
    fill_decode_buffers,
    graph_batch_sizes,
)
from engine.backends.step_dispatch import PAD_BLOCKS, normalize_cuda_graph_flag
from engine.kv_cache import PagedKVCache, kv_geometry
from engine.testing import build_test_model
from tests.gpu.helpers import EagerCapturer, hf_forward, meta_for


@pytest.mark.parametrize(
    "value, expected",
    [(None, (False, True)), (True, (True, True)), (False, (False, False)), ((False, True), (False, True)),
     ([True, False], (True, False))],
)  # fmt: skip
def test_flag_normalisation_on_cuda(value, expected):
    assert normalize_cuda_graph_flag(value, "cuda") == expected


@pytest.mark.parametrize("value", ["yes", 1, (True,), (True, 1), [True, False, True], {"decode": True}])
def test_bad_flag_names_the_field(value):
    with pytest.raises(ValueError, match="use_cuda_graph must be a bool or a \\(varlen, decode\\) pair"):
        normalize_cuda_graph_flag(value, "cuda")


def test_graphs_are_off_on_cpu_or_with_an_uncapturable_backend(caplog):
    with caplog.at_level(logging.WARNING, logger="cbserve.cuda_graphs"):
        assert normalize_cuda_graph_flag(None, "cpu") == (False, False)
        assert not caplog.records  # not asked for: no warning
        assert normalize_cuda_graph_flag(True, "cpu") == (False, False)
        assert normalize_cuda_graph_flag((False, True), "cuda", backend_supports_graphs=False) == (False, False)
    assert "the device is cpu" in caplog.records[0].getMessage()
    assert "cannot be captured" in caplog.records[1].getMessage()


@pytest.mark.parametrize(
    "cap, sizes",
    [(1, [1]), (2, [1, 2]), (8, [1, 2, 4, 8]), (12, [1, 2, 4, 8, 12]), (256, [1, 2, 4, 8, 16, 32, 64, 128, 256])],
)
def test_buckets_are_powers_of_two_up_to_the_cap(cap, sizes):
    assert graph_batch_sizes(cap) == sizes


@pytest.mark.parametrize("cap", [0, -3, 2.5, True, None])
def test_bad_request_cap(cap):
    with pytest.raises(ValueError, match="max_requests"):
        graph_batch_sizes(cap)


def test_bucket_is_the_smallest_that_holds_the_batch():
    sizes = graph_batch_sizes(12)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 12)] == [1, 2, 4, 8, 8, 12, 12]
    assert bucket_for(13, sizes) is None
    with pytest.raises(ValueError):
        bucket_for(0, sizes)


def test_graph_key_only_for_pure_decode_steps_that_fit():
    sizes = graph_batch_sizes(8)
    decode3 = meta_for([[1], [2, 3], [4]], [5, 20, 9], [1, 1, 1], 16)
    assert choose_decode_graph(decode3, sizes, max_blocks_per_seq=4) == 4
    mixed = meta_for([[1], [2, 3]], [5, 20], [1, 7], 16)
    assert choose_decode_graph(mixed, sizes, max_blocks_per_seq=4) is None
    wide = meta_for([[1, 2, 3, 4, 5]], [70], [1], 16)
    assert choose_decode_graph(wide, sizes, max_blocks_per_seq=4) is None
    many = meta_for([[i] for i in range(9)], [3] * 9, [1] * 9, 16)
    assert choose_decode_graph(many, sizes, max_blocks_per_seq=4) is None


def test_padding_rows_point_at_the_padding_block_only():
    buf = DecodeBuffers.allocate(8, max_blocks_per_seq=4, device="cpu")
    buf.block_tables.fill_(99)  # stale values from an earlier step must not survive
    meta = meta_for([[1], [2, 3], [4]], [5, 20, 9], [1, 1, 1], 16)
    fill_decode_buffers(buf, 4, torch.tensor([11, 12, 13]), torch.tensor([4, 19, 8]), meta, pad_block=7)
    assert buf.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buf.positions[:4].tolist() == [4, 19, 8, 0]
    assert buf.slot_mapping[:4].tolist() == [1 * 16 + 4, 3 * 16 + 3, 4 * 16 + 8, 7 * 16]
    assert buf.seq_lens_k[:4].tolist() == [5, 20, 9, 1]
    assert buf.block_tables[:4].tolist() == [[1, 0, 0, 0], [2, 3, 0, 0], [4, 0, 0, 0], [7, 0, 0, 0]]
    assert buf.cu_seqlens_q[:5].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="does not fit bucket 2"):
        fill_decode_buffers(buf, 2, torch.tensor([11, 12, 13]), torch.tensor([4, 19, 8]), meta, pad_block=7)


BS, NUM_BLOCKS = 16, 24


def _prefill(model, cache, prompts, tables):
    """Run the prompts eagerly with the CPU backend; return the greedy next token of each."""
    backend = SDPABackend()
    forward = hf_forward(model, backend, cache)
    meta = meta_for(tables, [len(p) for p in prompts], [len(p) for p in prompts], BS)
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    last = (meta.cu_seqlens_q[1:] - 1).long()
    with torch.inference_mode():
        return forward(ids, positions, meta, last).argmax(-1)


def test_runner_replays_equal_eager_decode_and_padding_touches_only_the_pad_block():
    torch.manual_seed(0)
    model = build_test_model("llama", vocab_size=512)
    layers, hkv, hd = kv_geometry(model.config)
    cache = PagedKVCache(layers, NUM_BLOCKS + PAD_BLOCKS, BS, hkv, hd, torch.float32)
    pad_block = NUM_BLOCKS
    prompts = [list(range(5, 40)), list(range(100, 107)), list(range(200, 220))]
    tables = [[3, 9, 4], [0], [7, 12]]
    tokens = _prefill(model, cache, prompts, tables)

    backend = SDPACudaBackend()  # shape-static decode path, capturable like flash-attn's
    capturer = EagerCapturer()
    runner = DecodeGraphRunner(
        hf_forward(model, backend, cache), max_requests=6, max_blocks_per_seq=4, block_size=BS,
        pad_block=pad_block, device="cpu", capturer=capturer,
    )  # fmt: skip
    runner.warmup()
    assert capturer.order == [6, 4, 2, 1]  # largest first: one pool sized by the first capture
    assert not cache.k[0][1].any(), "warm-up wrote outside the padding block"  # block 1 belongs to no one

    lens = [len(p) for p in prompts]
    for step in range(3):  # three decode steps, each through the graph of bucket 4 (3 sequences)
        meta = meta_for(tables, [n + 1 for n in lens], [1, 1, 1], BS)
        positions = torch.tensor(lens)
        before = [t.clone() for t in cache.k]
        assert runner.graph_for(meta) == 4
        logits = runner.run(tokens, positions, meta).clone()
        graph_cache = [t.clone() for t in cache.k]
        # the same step eagerly, from the cache as it was, with the CPU backend
        for t, b in zip(cache.k, before):
            t.copy_(b)
        with torch.inference_mode():
            expected = hf_forward(model, SDPABackend(), cache)(tokens, positions, meta, torch.arange(3))
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        for g, e in zip(graph_cache, cache.k):
            torch.testing.assert_close(g[:pad_block], e[:pad_block], atol=1e-5, rtol=1e-5)
        tokens = logits.argmax(-1)
        lens = [n + 1 for n in lens]
    assert runner.replays == 3
    assert not cache.k[0][1].any(), "padding rows wrote outside the padding block"
    assert cache.k[0][pad_block].any(), "padding rows write their key into the padding block"


def test_runner_refuses_steps_without_a_graph():
    model = build_test_model("llama", vocab_size=512)
    layers, hkv, hd = kv_geometry(model.config)
    cache = PagedKVCache(layers, NUM_BLOCKS + PAD_BLOCKS, BS, hkv, hd, torch.float32)
    runner = DecodeGraphRunner(
        hf_forward(model, SDPACudaBackend(), cache), max_requests=2, max_blocks_per_seq=2, block_size=BS,
        pad_block=NUM_BLOCKS, device="cpu", capturer=EagerCapturer(),
    )  # fmt: skip
    meta = meta_for([[1], [2], [3]], [3, 3, 3], [1, 1, 1], BS)
    assert runner.graph_for(meta) is None  # nothing captured yet
    runner.warmup()
    assert runner.graph_for(meta) is None  # 3 > the cap of 2
    with pytest.raises(ValueError, match="no captured graph"):
        runner.run(torch.tensor([1, 2, 3]), torch.tensor([2, 2, 2]), meta)


def test_every_graph_writes_into_one_shared_output_buffer():
    model = build_test_model("llama", vocab_size=512)
    layers, hkv, hd = kv_geometry(model.config)
    cache = PagedKVCache(layers, NUM_BLOCKS + PAD_BLOCKS, BS, hkv, hd, torch.float32)
    runner = DecodeGraphRunner(
        hf_forward(model, SDPACudaBackend(), cache), max_requests=8, max_blocks_per_seq=2, block_size=BS,
        pad_block=NUM_BLOCKS, device="cpu", capturer=EagerCapturer(),
    )  # fmt: skip
    runner.warmup()
    buffer = runner.output.buffer
    assert buffer is not None and buffer.shape == (8, 512)
    assert all(g.output.data_ptr() == buffer.data_ptr() for g in runner.graphs.values())
