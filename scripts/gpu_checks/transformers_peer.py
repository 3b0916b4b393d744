"""The throughput check's workload on transformers' own continuous batching, `model.generate_batch`.

The same model (throughput.py's shape, seed and dtype: the same weights) and the same prompts, in
this row's own process, through transformers' `generate_batch` with its defaults (its manager built
and warmed inside the call; a paged flash attention when flash-attn is installed, else paged SDPA),
greedy, `max_new_tokens` as in throughput.py and no EOS (`eos_token_id=-1`). Its time is taken from the requests' own
lifespans (first request scheduled to last finished: the manager's build and warm-up left out, as
throughput.py leaves out the engine's); the whole call is reported too. On the CPU (the smoke run) its
cache is sized to the workload (64 blocks, 1024 batch tokens): by default transformers sizes it to 80%
of the machine's whole RAM whatever else runs there, and writes all of it. Asserted: every request
produced all its tokens. The ratio to cbserve's output tokens per second (throughput.py's row of this
run) is reported beside the target, cbserve at least 2x.
"""

from __future__ import annotations

import time

from scripts.gpu_checks import throughput
from scripts.gpu_checks.common import Context
from scripts.gpu_checks.report import require

NAME = "throughput against transformers' generate_batch"
TIMEOUT_S = 240
TARGET = 2.0  # cbserve's output tok/s over transformers'


def run(ctx: Context) -> dict:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    m = throughput.model(ctx)
    w = throughput.workload(ctx)
    config = GenerationConfig(max_new_tokens=w["new"], do_sample=False, eos_token_id=-1, pad_token_id=0)  # -1: no EOS
    ctx.sync()
    start = time.perf_counter()
    # its warm-up captures CUDA graphs: on the CPU it only costs time
    cb_config = None if ctx.cuda else ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=1024)
    out = m.generate_batch(inputs=w["prompts"], generation_config=config, continuous_batching_config=cb_config,
                           progress_bar=False, warmup=ctx.cuda)  # fmt: skip
    ctx.sync()
    call_s = time.perf_counter() - start
    results = list(out.values())
    tokens = sum(len(r.generated_tokens) for r in results)
    lifespans = [r.lifespan for r in results if r.lifespan[0] >= 0]
    run_s = max(end for _, end in lifespans) - min(begin for begin, _ in lifespans) if lifespans else call_s
    figures = {"model": throughput.shape_name(ctx), "attention": m.config._attn_implementation,
               "requests": f"{len(results)}/{len(w['prompts'])}", "run s": run_s, "call s (build and warm-up too)": call_s,
               "output tok/s": tokens / run_s}  # fmt: skip
    ours = ctx.earlier("throughput")
    if ours and ours.get("status") == "pass":
        ratio = ours["figures"]["output tok/s"] / figures["output tok/s"]
        figures.update({"cbserve output tok/s": ours["figures"]["output tok/s"], "cbserve / transformers": ratio})
        if ctx.cuda:
            figures[f"target {TARGET:g}x met"] = ratio >= TARGET
    require(len(results) == len(w["prompts"]) and tokens == len(w["prompts"]) * w["new"],
            f"{len(results)} results, {tokens} tokens; {len(w['prompts']) * w['new']} expected", figures)  # fmt: skip
    return figures
