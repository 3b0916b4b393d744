"""The engine's own loop (scheduler, chunked prefill, sampler) with its steps dispatched to graphs.

The engine does not route its steps through `StepDispatcher` yet (see docs/gpu.md, "Wiring"); this
test wires it the way the engine will: a cache with the padding block, the step's metadata from the
engine's model runner, graphs replayed by the eager stand-in for CUDA graphs. Greedy tokens must not
change: decode graphs against transformers' model.generate (float32, the SDPA backend), decode and
varlen graphs against the same engine without graphs (bfloat16, flash-attn's kernels as references).
"""

from __future__ import annotations

import torch

from engine.backends.cuda import FlashAttnBackend, SDPACudaBackend
from engine.config import ContinuousBatchingConfig
from engine.kv_cache import PagedKVCache, kv_geometry
from engine.llm_engine import LLMEngine
from engine.backends.step_dispatch import StepDispatcher, graph_table_width
from engine.testing import build_test_model, random_prompts
from tests.gpu.helpers import EagerCapturer, FlashReference, hf_forward

NEW = 12


def graphed_engine(model, backend, config, graph_flags) -> LLMEngine:
    """An engine whose executor's cache (with the padding block), backend and dispatch are replaced:
    the engine's own step runs them, graphs captured (by the eager stand-in) in its warm-up."""
    engine = LLMEngine(model, config)
    n, bs = engine.sizes.num_blocks, config.block_size
    layers, hkv, hd = kv_geometry(model.config)
    dtype = next(model.parameters()).dtype
    ex = engine.executor
    ex.cache = ex.runner.cache = PagedKVCache(layers, n + 1, bs, hkv, hd, dtype)
    ex.backend = ex.runner.backend = backend
    ex.dispatch = StepDispatcher(
        hf_forward(model, backend, ex.cache), graph_flags=graph_flags, device="cpu",
        max_requests=engine.sizes.max_requests, max_batch_tokens=engine.sizes.max_batch_tokens,
        max_blocks_per_seq=graph_table_width(n, bs, engine.max_context), block_size=bs, pad_block=n,
        capturer=EagerCapturer(),
    )  # fmt: skip
    ex.warmup()
    return engine


def serve(engine: LLMEngine, prompts) -> list[list[int]]:
    reqs = [engine.make_request(p, max_new_tokens=NEW, ignore_eos=True) for p in prompts]
    for r in reqs:
        engine.add_request(r)
    with torch.inference_mode():
        while engine.has_unfinished():
            engine.step()
    return [r.generated_ids for r in reqs]


def run_engine(model, backend, config, prompts, graph_flags):
    engine = graphed_engine(model, backend, config, graph_flags)
    out = serve(engine, prompts)
    engine.close()
    return out, engine.executor.dispatch


def test_decode_graphs_in_the_engine_loop_equal_model_generate():
    model = build_test_model("qwen3", vocab_size=512)
    prompts = random_prompts(6, 3, 120, 512, seed=3)
    config = ContinuousBatchingConfig(block_size=16, num_blocks=64, max_batch_tokens=96, max_requests_per_batch=4)
    got, dispatch = run_engine(model, SDPACudaBackend(), config, prompts, (False, True))
    assert dispatch.graphs.replays > NEW  # most steps are decodes, and they replayed graphs
    with torch.no_grad():
        for p, tokens in zip(prompts, got):
            ref = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=3)
            assert tokens == ref[0, len(p) :].tolist()


def test_decode_and_varlen_graphs_in_the_engine_loop_change_no_token():
    model = build_test_model("llama", vocab_size=512).to(torch.bfloat16)
    prompts = random_prompts(6, 3, 300, 512, seed=4)
    config = ContinuousBatchingConfig(block_size=256, num_blocks=12, max_batch_tokens=256, max_requests_per_batch=4)
    ref = FlashReference()
    eager, _ = run_engine(model, FlashAttnBackend(ref.varlen, ref.kvcache), config, prompts, (False, False))
    graphed, dispatch = run_engine(model, FlashAttnBackend(ref.varlen, ref.kvcache), config, prompts, (True, True))
    assert dispatch.graphs.replays > 0 and dispatch.varlen_graphs.replays > 0
    assert graphed == eager


def test_weights_replaced_by_new_tensors_are_captured_again_and_forget_cached_prefixes():
    """Graphs read the memory they were captured over: a weight that is a new tensor (not changed in
    place) is noticed at the next step, the graphs are captured again and the prefix cache, whose K/V
    came from the old weights, is forgotten; the tokens follow the new weights."""
    model = build_test_model("qwen3", vocab_size=512)
    prompts = random_prompts(4, 40, 80, 512, seed=5)
    config = ContinuousBatchingConfig(block_size=16, num_blocks=64, max_batch_tokens=96, max_requests_per_batch=4)
    engine = graphed_engine(model, SDPACudaBackend(), config, (False, True))
    ex, dispatch = engine.executor, engine.executor.dispatch

    def run() -> list[list[int]]:
        return serve(engine, prompts)

    def expected() -> list[list[int]]:
        with torch.no_grad():
            return [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                   pad_token_id=3)[0, len(p):].tolist() for p in prompts]  # fmt: skip

    assert run() == expected()
    captured = dict(dispatch.graphs.graphs)
    layer = model.model.layers[0].mlp.down_proj
    layer.weight = torch.nn.Parameter(layer.weight.detach() * 1.5)  # a new tensor: the graphs' memory is stale
    assert ex.weights_moved()
    hits = engine.stats()["prefix_cache_hits_total"]
    assert run() == expected()  # the same prompts: cached prefixes from the old weights would change the tokens
    assert engine.stats()["prefix_cache_hits_total"] == hits  # forgotten, not hit
    assert set(dispatch.graphs.graphs) == set(captured)
    assert all(dispatch.graphs.graphs[b] is not captured[b] for b in captured)  # captured again
    assert not ex.weights_moved()
    engine.close()
