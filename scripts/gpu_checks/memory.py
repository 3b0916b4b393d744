"""The KV plan against the memory a full-load step really reserves; no OOM at full load.

The engine is built on the throughput model with `num_blocks` unset (sized from free memory after
the profiling forward) and both kinds of CUDA graphs when the attention backend supports them,
warmed, then given one full-load step: `max_requests` sampled requests (temperature, top-k, top-p)
whose prompts fill `max_batch_tokens`, followed by decode steps. Asserted: no out-of-memory error,
the full-load step ran every request, and the peak of `torch.cuda.max_memory_reserved()` (all the
memory torch's allocator held from the device, over the build and the steps) is within what the plan
allowed: the memory torch held before the build plus the free memory at sizing x
`max_memory_percent`. On the CPU the same steps run against the CPU's capped plan, without peak
figures.
"""

from __future__ import annotations

import torch

from scripts.gpu_checks import throughput
from scripts.gpu_checks.common import Context, serve_all
from scripts.gpu_checks.report import CheckFailed, require

NAME = "memory plan at full load"
TIMEOUT_S = 150
GiB = 1 << 30


def run(ctx: Context) -> dict:
    from engine.llm_engine import LLMEngine

    model = throughput.model(ctx)
    config = ctx.config(use_cuda_graph=ctx.graphs) if ctx.cuda else ctx.config(max_batch_tokens=64, max_requests_per_batch=8)
    if ctx.cuda:
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
    try:
        engine = LLMEngine(model, config)
        try:
            engine.warmup()
            plan = engine.sizes
            rows, tokens = plan.max_requests, plan.max_batch_tokens
            length = max(1, tokens // rows)
            vocab = model.config.vocab_size
            prompts = [[4 + (i * 7 + j) % (vocab - 4) for j in range(length)] for i in range(rows)]
            steps = []
            serve_all(engine, prompts, 4, on_step=lambda e: steps.append(e.stats()["num_requests_running"]),
                      temperature=1.0, top_k=50, top_p=0.9, seed=1)  # fmt: skip
        finally:
            engine.close()
    except torch.cuda.OutOfMemoryError as exc:
        raise CheckFailed(f"out of memory at full load: {exc}") from None
    figures = {"max_requests": rows, "max_batch_tokens": tokens, "prompt length": length,
               "kv blocks": plan.num_blocks, "kv GiB": plan.cache_bytes / GiB,
               "activation reserve GiB": plan.activation_peak_bytes / GiB,
               "most running in a step": max(steps, default=0)}  # fmt: skip
    require(max(steps, default=0) == rows, f"the full-load step ran {max(steps, default=0)} of {rows} requests", figures)
    if not ctx.cuda:
        figures["peak"] = "n/a on the CPU"
        return figures
    peak = torch.cuda.max_memory_reserved(ctx.device)
    total = torch.cuda.get_device_properties(ctx.device).total_memory
    allowed = before + int(plan.free_bytes * (config.max_memory_percent or 0.9))
    figures.update({"peak reserved GiB": peak / GiB, "peak allocated GiB": torch.cuda.max_memory_allocated(ctx.device) / GiB,
                    "plan allowed GiB": allowed / GiB, "device GiB": total / GiB, "graphs": ctx.graphs})  # fmt: skip
    require(peak <= allowed, f"the peak reserved, {peak / GiB:.2f} GiB, is above the plan's {allowed / GiB:.2f} GiB", figures)
    return figures
