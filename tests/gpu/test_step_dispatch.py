"""engine/backends/step_dispatch.py: which way each step's forward runs, and that every way gives the same logits."""

from __future__ import annotations

import pytest
import torch

from engine.backends.cpu import SDPABackend
from engine.backends.cuda import SDPACudaBackend
from engine.config import ContinuousBatchingConfig
from engine.kv_cache import PagedKVCache, kv_geometry
from engine.backends.step_dispatch import StepDispatcher, graph_table_width
from engine.testing import build_test_model
from tests.gpu.helpers import EagerCapturer, hf_forward, meta_for

BS, NUM_BLOCKS = 16, 20


@pytest.fixture(scope="module")
def model():
    return build_test_model("qwen3", vocab_size=512)


def new_cache(model):
    layers, hkv, hd = kv_geometry(model.config)
    return PagedKVCache(layers, NUM_BLOCKS + 1, BS, hkv, hd, torch.float32)


def test_on_cpu_it_is_the_eager_forward(model):
    cache = new_cache(model)
    config = ContinuousBatchingConfig(block_size=BS, use_cuda_graph=True)
    dispatch = StepDispatcher.from_config(
        hf_forward(model, SDPABackend(), cache), config, SDPABackend(), "cpu",
        block_size=BS, num_blocks=NUM_BLOCKS, max_requests=8, max_batch_tokens=64, max_context=512,
    )  # fmt: skip
    assert dispatch.graph_flags == (False, False) and dispatch.graphs is None and dispatch.reserved_blocks == 0
    dispatch.warmup()  # nothing to capture


def test_graph_table_width():
    assert graph_table_width(100, 16, 512) == 32
    assert graph_table_width(10, 16, 512) == 10
    assert graph_table_width(100, 16, None, max_blocks_per_request=4) == 4


def test_decode_steps_replay_graphs_and_other_steps_run_eagerly(model):
    cache = new_cache(model)
    backend = SDPACudaBackend()
    dispatch = StepDispatcher(
        hf_forward(model, backend, cache), graph_flags=(False, True), device="cpu", max_requests=4, max_batch_tokens=64,
        max_blocks_per_seq=4, block_size=BS, pad_block=NUM_BLOCKS, capturer=EagerCapturer(),
    )  # fmt: skip
    assert dispatch.reserved_blocks == 1
    dispatch.warmup()
    eager = hf_forward(model, SDPABackend(), cache)

    # a mixed step: two prompts prefill, runs eagerly
    prompts = [list(range(10, 33)), list(range(40, 45))]
    tables = [[4, 8], [1]]
    meta = meta_for(tables, [23, 5], [23, 5], BS)
    ids = torch.tensor(prompts[0] + prompts[1])
    pos = torch.cat([torch.arange(23), torch.arange(5)])
    rows = torch.tensor([22, 27])
    with torch.inference_mode():
        logits = dispatch(ids, pos, meta, rows)
    assert dispatch.graphs.replays == 0
    tokens = logits.argmax(-1)

    # a decode step of both, only the second sampling: the graph of bucket 2
    meta = meta_for(tables, [24, 6], [1, 1], BS)
    pos = torch.tensor([23, 5])
    snapshot = [t.clone() for t in cache.k + cache.v]
    with torch.inference_mode():
        got = dispatch(tokens, pos, meta, torch.tensor([1]))
    assert dispatch.graphs.replays == 1 and got.shape == (1, 512)
    for t, s in zip(cache.k + cache.v, snapshot):
        t.copy_(s)
    with torch.inference_mode():
        expected = eager(tokens, pos, meta, torch.tensor([1]))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)

    # a decode step larger than the cap runs eagerly
    big = meta_for([[i] for i in range(5)], [2] * 5, [1] * 5, BS)
    with torch.inference_mode():
        dispatch(torch.tensor([5, 6, 7, 8, 9]), torch.ones(5, dtype=torch.long), big, torch.arange(5))
    assert dispatch.graphs.replays == 1


def test_decode_and_varlen_graphs_share_one_capturer_and_pool():
    dispatch = StepDispatcher(
        lambda *a: None, graph_flags=(True, True), device="meta", max_requests=4, max_batch_tokens=64,
        max_blocks_per_seq=4, block_size=256, pad_block=9,
    )  # fmt: skip  (buffers on the meta device: no memory, no CUDA)
    assert dispatch.graphs.capturer is dispatch.varlen_graphs.capturer
