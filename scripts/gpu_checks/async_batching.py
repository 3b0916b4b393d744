"""Async batching (`use_async_batching`) against one step at a time: the same tokens, and what it saves.

Two engines on one model, one with async batching (each step launched before the last one's tokens
are back on the host; decodes scheduled ahead, fed their tokens on the device) and one without,
both with the pod's defaults (decode graphs where the attention backend supports them). On CUDA the
model is the throughput row's 1B shape (random weights made on the device), where the host's work
between steps is the largest share of a decode step; on the CPU a test model. Two workloads, each
run on the two engines in turn, twice (ABAB, after one untimed run each): 16 prompts of 128-512
tokens decoding 128 new tokens each, and one prompt alone decoding 128. Reported: output tokens/s of
each engine (median of its runs), the ratio, and the steps scheduled ahead. Asserted: the two
engines' tokens are the same (on CUDA: the same in at least `min_exact` of the sequences, near-ties
in bfloat16 may flip where step shapes differ), and steps did run ahead (on the CPU, where an engine
turns async batching down, with CBSERVE_ASYNC_BATCHING_ON_CPU=1).
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from scripts.gpu_checks import throughput
from scripts.gpu_checks.common import Context, serve_all
from scripts.gpu_checks.report import require

NAME = "async batching against one step at a time"
TIMEOUT_S = 180


def _model(ctx: Context):
    if not ctx.cuda:
        return ctx.test_model("llama")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**throughput.SHAPES["1B"], max_position_embeddings=4096)
    with torch.device(ctx.device):
        return LlamaForCausalLM(config).to(ctx.dtype).eval()


def run(ctx: Context) -> dict:
    from engine.backends.cpu_executor import ASYNC_ON_CPU_ENV
    from engine.llm_engine import LLMEngine
    from engine.testing import random_prompts

    if not ctx.cuda:
        os.environ[ASYNC_ON_CPU_ENV] = "1"  # the smoke run holds the pipeline to one step at a time (this row's process)

    model = _model(ctx)
    vocab = model.config.vocab_size
    new = 16 if ctx.quick else 128
    loads = {"16 users": random_prompts(4 if ctx.quick else 16, 32 if ctx.quick else 128, 64 if ctx.quick else 512,
                                        vocab, seed=7),
             "1 user": random_prompts(1, 64, 64, vocab, seed=8)}  # fmt: skip
    # a cache for the loads (32,768 tokens on CUDA, 2,048 on the CPU), not sized from free memory: two engines
    engines = {flag: LLMEngine(model, ctx.config(use_async_batching=flag, max_requests_per_batch=16, num_blocks=128))
               for flag in (False, True)}  # fmt: skip
    figures: dict = {"model": "1B" if ctx.cuda else "test model", "new tokens": new}
    outputs: dict = {}
    try:
        for engine in engines.values():
            engine.warmup()
        for load, prompts in loads.items():
            rates: dict[bool, list[float]] = {False: [], True: []}
            for turn in range(3):  # the first of each untimed
                for flag, engine in engines.items():
                    ctx.sync()
                    start = time.perf_counter()
                    out = serve_all(engine, prompts, new)
                    ctx.sync()
                    if turn:
                        rates[flag].append(len(prompts) * new / (time.perf_counter() - start))
                    outputs[(load, flag)] = [seqs[0] for seqs in out]
            one, ahead = (statistics.median(rates[f]) for f in (False, True))
            figures[f"{load}: output tok/s, one step at a time"] = one
            figures[f"{load}: output tok/s, async batching"] = ahead
            figures[f"{load}: async / one at a time"] = ahead / one
        figures["steps run ahead"] = engines[True].steps_ahead
    finally:
        for engine in engines.values():
            engine.close()
    same = sum(outputs[(load, True)][i] == outputs[(load, False)][i] for load in loads
               for i in range(len(loads[load])))  # fmt: skip
    total = sum(len(p) for p in loads.values())
    figures["sequences the same"] = f"{same}/{total}"
    require(figures["steps run ahead"] > 0, "no step was scheduled ahead", figures)
    need = total if ctx.exact_required else ctx.min_exact * total
    require(same >= need, f"{same} of {total} sequences the same with and without async batching", figures)
    return figures
