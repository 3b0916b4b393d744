"""Steady-state throughput of an 8B-shaped random Llama, the engine's build (sizing, KV allocation,
graph capture) timed apart.

The model is Llama-3-8B's shape (hidden 4096, 32 layers, 32 heads over 8 KV heads, MLP 14336,
vocabulary 128256), random weights made on the device in bfloat16 (16 GB); `--small` takes a 1B
shape instead, the CPU a tiny one. One engine (the pod's defaults: decode graphs) is built and warmed
once, timed; then the workload (greedy, EOS ignored) runs once untimed and `runs` times timed, the
median reported as output tokens per second. Nothing is asserted but that every request produced
all its tokens: the row is a measurement.
"""

from __future__ import annotations

import statistics
import time

import torch

from scripts.gpu_checks.common import Context, serve_all

NAME = "throughput, 8B-shaped Llama"
SHAPES = {
    "8B": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256),
    "1B": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=1024),
}  # fmt: skip


def shape_name(ctx: Context) -> str:
    return "tiny" if not ctx.cuda else ("1B" if ctx.small else "8B")


def workload(ctx: Context) -> dict:
    """Prompts, their lengths and the new tokens of one timed run."""
    from engine.testing import random_prompts

    vocab = SHAPES[shape_name(ctx)]["vocab_size"]
    if ctx.cuda:
        return dict(prompts=random_prompts(128, 128, 1024, vocab, seed=0), new=128, runs=3)
    return dict(prompts=random_prompts(4 if ctx.quick else 8, 16, 64, vocab, seed=0), new=4 if ctx.quick else 8, runs=1)


def model(ctx: Context):
    """The throughput model, built once per run and shared (the memory check loads it too)."""
    if "big_model" not in ctx.shared:
        from transformers import AutoModelForCausalLM, LlamaConfig

        torch.manual_seed(0)
        config = LlamaConfig(**SHAPES[shape_name(ctx)], max_position_embeddings=8192, tie_word_embeddings=False)
        with torch.device(ctx.device):
            ctx.shared["big_model"] = AutoModelForCausalLM.from_config(config, dtype=ctx.dtype).eval()
    return ctx.shared["big_model"]


def run(ctx: Context) -> dict:
    from engine.llm_engine import LLMEngine

    m = model(ctx)
    w = workload(ctx)
    ctx.sync()
    start = time.perf_counter()
    engine = LLMEngine(m, ctx.config())
    engine.warmup()
    ctx.sync()
    build = time.perf_counter() - start
    times = []
    try:
        serve_all(engine, w["prompts"][:8], 8)  # untimed: first steps of every shape
        for _ in range(w["runs"]):
            ctx.sync()
            t0 = time.perf_counter()
            out = serve_all(engine, w["prompts"], w["new"])
            ctx.sync()
            times.append(time.perf_counter() - t0)
            assert all(len(seqs[0]) == w["new"] for seqs in out), "a request stopped early"
        placement = engine.placement()
    finally:
        engine.close()
    tokens = len(w["prompts"]) * w["new"]
    prompt_tokens = sum(map(len, w["prompts"]))
    seconds = statistics.median(times)
    ctx.shared["cbserve_tok_s"] = tokens / seconds
    ctx.shared["workload"] = w
    return {"model": shape_name(ctx), "dtype": placement["dtype"], "engine build s": build,
            "output tok/s": tokens / seconds, "total tok/s": (tokens + prompt_tokens) / seconds,
            "workload": f"{len(w['prompts'])} prompts, {prompt_tokens} prompt tokens, {w['new']} new each",
            "kv tokens": placement["kv_cache_tokens"], "median of": w["runs"]}  # fmt: skip
