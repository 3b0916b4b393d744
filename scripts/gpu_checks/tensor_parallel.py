"""Tensor parallel over two ranks against one: greedy tokens on the test Llama, and throughput.

With two GPUs (NCCL), or two CPU ranks (gloo) with `--device cpu --two-ranks`; skipped otherwise.
Tokens: exact matches and the mean common prefix (a row passes at --min-exact). Throughput: the W1
Llama (64 prompts of 16-256 tokens, 64 new tokens; 8 x 8 in --quick), output tok/s of each, the
engine's start-up timed too (generate_batch builds an engine per call).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from scripts.gpu_checks.common import Context, matches
from scripts.gpu_checks.report import Skipped, require, table

NAME = "tensor parallel, 2 ranks against 1"
TIMEOUT_S = 120
W1 = dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)  # fmt: skip


def requirement(ctx: Context) -> str | None:
    """Why the row cannot run here (scripts/gpu_check.py asks before starting its process), or None."""
    gpus = torch.cuda.device_count() if ctx.cuda else 0
    if gpus < 2 and not (not ctx.cuda and ctx.two_ranks):
        return f"{gpus} GPU here, it needs two" if ctx.cuda else "two CPU ranks only with --two-ranks"
    return None


def run(ctx: Context) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engine import generate_batch
    from engine.testing import random_prompts

    absent = requirement(ctx)
    if absent:
        raise Skipped(absent)

    def generate(model, prompts, ranks: int, new: int) -> list[list[int]]:
        config = dataclasses.replace(ctx.config(use_cuda_graph=False), tensor_parallel_size=ranks)
        outs = generate_batch(model, prompts, continuous_batching_config=config, max_new_tokens=new,
                              ignore_eos=True, progress_bar=False)  # fmt: skip
        return [o.generated_tokens for o in outs.values()]

    new = 4 if ctx.quick else 32
    model = ctx.test_model("llama")
    prompts = random_prompts(2 if ctx.quick else 16, 3, 200, 512, seed=0)
    m = matches(generate(model, prompts, 2, new), generate(model, prompts, 1, new))
    rows = [["greedy tokens, 2 ranks against 1 (test Llama)", f"{m['exact']}/{m['total']} exact",
             f"mean common prefix {m['mean_prefix']:.1f}/{new}"]]  # fmt: skip
    torch.manual_seed(0)
    w1 = AutoModelForCausalLM.from_config(LlamaConfig(**W1), dtype=torch.float32).to(ctx.device, ctx.dtype).eval()
    count, w1_new = (8, 8) if ctx.quick else (64, 64)
    w1_prompts = random_prompts(count, 16, 256, W1["vocab_size"], seed=0)
    rates = {}
    for ranks in (1, 2):
        ctx.sync()
        start = time.perf_counter()
        generate(w1, w1_prompts, ranks, w1_new)
        ctx.sync()
        rates[ranks] = count * w1_new / (time.perf_counter() - start)
    rows.append(["W1 output tok/s (engine start-up timed too)", f"1 rank {rates[1]:.0f}, 2 ranks {rates[2]:.0f}",
                 f"2 ranks are {rates[2] / rates[1]:.2f}x"])  # fmt: skip
    where = "two GPUs (NCCL)" if ctx.cuda else "two CPU ranks (gloo)"
    figures = {"exact": f"{m['exact']}/{m['total']}", "mean prefix": m["mean_prefix"],
               "2 ranks / 1 rank": rates[2] / rates[1], "on": where,
               "_detail": f"### Tensor parallel on {where}, {str(ctx.dtype).removeprefix('torch.')}\n\n"
                          + table(["check", "result", ""], rows)}  # fmt: skip
    require(m["exact"] >= ctx.min_exact * m["total"], f"{m['exact']}/{m['total']} exact", figures)
    return figures
