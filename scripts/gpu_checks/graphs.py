"""CUDA graphs: every graph captured in `warmup()`, none while serving, replayed, and equal to eager.

An engine with `use_cuda_graph=True` (decode and varlen graphs) warms up; the count of captured
graphs must be the decode buckets plus the varlen keys of `warmup_keys()`. It then serves prompts of
mixed lengths; at every step that replayed a graph, the same step is run again eagerly (the
dispatcher's own eager forward, over the same inputs: it writes the same keys and values to the same
slots) and the logits compared. Asserted: decode and varlen replays both happened, the capture count
did not move while serving, and graph and eager logits agree (within a few units in the last place
of the model's dtype, relative to the largest logit). On the CPU the graphs are the eager capturer's
and the kernels the torch reference (bfloat16, blocks of 256), wired as tests/gpu/test_engine_with_graphs.py
wires them. On CUDA with an attention backend that graphs cannot capture (its `supports_graphs` is
false), the row is skipped with that reason.
"""

from __future__ import annotations

import torch

from scripts.gpu_checks.common import Context, serve_all
from scripts.gpu_checks.report import Skipped, require

NAME = "CUDA graphs captured, replayed, equal to eager"
TIMEOUT_S = 90
RELATIVE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


class GraphVsEager:
    """Stands where the executor keeps its dispatcher: each step that replays a graph is run once more
    eagerly and the two outputs compared."""

    def __init__(self, dispatch) -> None:
        self.dispatch = dispatch
        self.worst = 0.0  # largest |graph - eager| / max |eager|
        self.argmax_equal = self.rows = self.graph_steps = self.eager_steps = 0

    def __call__(self, input_ids, positions, meta, logits_rows):
        before = self.dispatch.replays
        out = self.dispatch(input_ids, positions, meta, logits_rows)
        if self.dispatch.replays == before:
            self.eager_steps += 1
            return out
        self.graph_steps += 1
        if out.shape[0] == 0:  # a prompt chunk that samples nothing
            return out
        graph = out.float().clone()
        pure_decode = meta.num_decodes == meta.num_seqs
        eager_forward = self.dispatch.decode_forward if pure_decode else self.dispatch.varlen_forward
        eager = eager_forward(input_ids, positions, meta, logits_rows).float()
        scale = eager.abs().max().item() or 1.0
        self.worst = max(self.worst, (graph - eager).abs().max().item() / scale)
        self.argmax_equal += int((graph.argmax(-1) == eager.argmax(-1)).sum())
        self.rows += graph.shape[0]
        return out

    def __getattr__(self, name: str):
        return getattr(self.dispatch, name)


def engine_with_graphs(ctx: Context, model, config):
    """An engine whose steps run through decode and varlen graphs: CUDA graphs on a GPU; on the CPU the
    eager capturer over flash-attn's reference kernels, with the cache's padding block."""
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(model, config)
    if ctx.cuda:
        return engine
    from engine.backends.cuda import FlashAttnBackend
    from engine.backends.step_dispatch import StepDispatcher, graph_table_width
    from engine.kv_cache import PagedKVCache, kv_geometry
    from tests.gpu.helpers import EagerCapturer, FlashReference, hf_forward

    n, bs = engine.sizes.num_blocks, config.block_size
    layers, hkv, hd = kv_geometry(model.config)
    ex = engine.executor
    ex.cache = ex.runner.cache = PagedKVCache(layers, n + 1, bs, hkv, hd, next(model.parameters()).dtype)
    ref = FlashReference()
    ex.backend = ex.runner.backend = backend = FlashAttnBackend(ref.varlen, ref.kvcache)
    ex.dispatch = StepDispatcher(
        hf_forward(model, backend, ex.cache), graph_flags=(True, True), device="cpu",
        max_requests=engine.sizes.max_requests, max_batch_tokens=engine.sizes.max_batch_tokens,
        max_blocks_per_seq=graph_table_width(n, bs, engine.max_context), block_size=bs, pad_block=n,
        capturer=EagerCapturer(),
    )  # fmt: skip
    return engine


def run(ctx: Context) -> dict:
    from engine.backends.cuda.graphs import graph_batch_sizes
    from engine.config import ContinuousBatchingConfig
    from engine.testing import random_prompts

    if ctx.cuda and not ctx.graphs:
        raise Skipped(ctx.no_graphs_reason())
    if ctx.cuda:
        model, dtype = ctx.test_model("llama"), ctx.dtype
        config = ctx.config(num_blocks=32, max_batch_tokens=512, max_requests_per_batch=8, use_cuda_graph=True)
        prompts, new = random_prompts(12, 20, 700, 512, seed=11), 16
    else:  # the reference kernels want half precision and blocks of 256
        model, dtype = ctx.test_model("llama").to(torch.bfloat16), torch.bfloat16
        config = ContinuousBatchingConfig(block_size=256, num_blocks=8, max_batch_tokens=128, max_requests_per_batch=4)
        prompts, new = random_prompts(4 if ctx.quick else 6, 3, 200, 512, seed=11), 4 if ctx.quick else 8
    engine = engine_with_graphs(ctx, model, config)
    try:
        engine.warmup()
        dispatch = engine.executor.dispatch
        require(dispatch.graphs is not None and dispatch.varlen_graphs is not None,
                "use_cuda_graph=True built no decode or no varlen graphs", {"attention": ctx.attention()[0]})  # fmt: skip
        expected = len(graph_batch_sizes(engine.sizes.max_requests)) + len(dispatch.varlen_graphs.warmup_keys())
        captured = dispatch.captured
        watch = engine.executor.dispatch = GraphVsEager(dispatch)
        serve_all(engine, prompts, new)
        figures = {"captured": captured, "expected": expected, "captured after serving": dispatch.captured,
                   "decode replays": dispatch.graphs.replays, "varlen replays": dispatch.varlen_graphs.replays,
                   "eager steps": watch.eager_steps, "graph-eager diff (share of largest logit)": watch.worst,
                   "argmax equal": f"{watch.argmax_equal}/{watch.rows}", "dtype": str(dtype).removeprefix("torch.")}  # fmt: skip
    finally:
        engine.close()
    require(captured == expected, f"{captured} graphs captured in warmup, {expected} expected", figures)
    require(figures["captured after serving"] == captured, "graphs were captured while serving", figures)
    require(dispatch.graphs.replays > 0 and dispatch.varlen_graphs.replays > 0, "a kind of graph never replayed", figures)
    require(watch.worst <= RELATIVE[dtype], f"graph and eager logits differ by {watch.worst:.3g} of the largest logit", figures)
    return figures
