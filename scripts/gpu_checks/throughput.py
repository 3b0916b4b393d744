"""Steady-state throughput of an 8B-shaped random Llama, the engine's build (sizing, KV allocation,
graph capture) timed apart, and a batch-1 decode step against the weights' bandwidth limit.

The model is Llama-3-8B's shape (hidden 4096, 32 layers, 32 heads over 8 KV heads, MLP 14336,
vocabulary 128256), random weights made on the device in bfloat16 (16 GB); `--small` takes a 1B
shape instead, the CPU a tiny one. One engine (the pod's defaults: decode graphs when the attention
backend supports them, a request cap of 256) is built and warmed once, timed; then a short untimed
run, then the workload once, timed: 256 prompts of 128-1,024 tokens, all added at once, 256 new
tokens each (greedy, EOS ignored), as output tokens per second. Then one request alone: the median
wall time of its decode steps (`engine.step()`, which returns with the sampled token on the host),
beside the weight-bandwidth limit (the parameters' bytes over the GPU's memory bandwidth, from its
memory clock and bus width; a measured device copy is reported too). Nothing is asserted but that
every request produced all its tokens: the row is a measurement, its targets reported beside it
(transformers_peer.py compares it with transformers' own continuous batching).
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from scripts.gpu_checks.common import Context, serve_all

NAME = "throughput, 8B-shaped Llama"
TIMEOUT_S = 240
REQUESTS = 256  # concurrent sequences on CUDA
STEP_TARGET = 1.2  # a batch-1 decode step within 20% of the weight-bandwidth limit
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
        return dict(prompts=random_prompts(REQUESTS, 128, 1024, vocab, seed=0), new=256, runs=1)
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


def weight_bytes(m) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def bandwidth(ctx: Context) -> dict[str, float]:
    """The GPU's memory bandwidth in bytes/s: its peak from the memory clock (double data rate) and bus
    width, and a device-to-device copy of 2 GiB measured (read and write counted)."""
    props = torch.cuda.get_device_properties(ctx.device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    gc.collect()
    torch.cuda.empty_cache()  # the closed engine's cache
    try:
        src = torch.empty(1 << 30, dtype=torch.int16, device=ctx.device)
        dst = torch.empty_like(src)
    except torch.cuda.OutOfMemoryError:
        return {"peak": 2 * clock_khz * 1e3 * bus_bits / 8, "copy": 0.0}
    dst.copy_(src)
    ctx.sync()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    ctx.sync()
    copied = 10 * 2 * src.numel() * src.element_size() / (time.perf_counter() - start)
    del src, dst
    return {"peak": 2 * clock_khz * 1e3 * bus_bits / 8, "copy": copied}


def decode_step_ms(ctx: Context, engine, vocab: int, steps: int) -> float:
    """The median wall time of one request's decode steps, alone in the engine."""
    from engine.request import RequestStatus
    from engine.testing import random_prompts

    req = engine.make_request(random_prompts(1, 512, 512, vocab, seed=1)[0], max_new_tokens=steps + 8, ignore_eos=True)
    engine.add_request(req)
    times = []
    with torch.inference_mode():
        while req.status != RequestStatus.DECODING:
            engine.step()
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
    engine.abort_request(req.request_id)
    with torch.inference_mode():
        while engine.has_unfinished():
            engine.step()
    return 1e3 * statistics.median(times)


def run(ctx: Context) -> dict:
    from engine.llm_engine import LLMEngine

    m = model(ctx)
    w = workload(ctx)
    ctx.sync()
    start = time.perf_counter()
    engine = LLMEngine(m, ctx.config(max_requests_per_batch=REQUESTS) if ctx.cuda else ctx.config())
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
        step_ms = decode_step_ms(ctx, engine, m.config.vocab_size, 64 if ctx.cuda else 4)
    finally:
        engine.close()
    tokens = len(w["prompts"]) * w["new"]
    prompt_tokens = sum(map(len, w["prompts"]))
    seconds = statistics.median(times)
    figures = {"model": shape_name(ctx), "dtype": placement["dtype"], "attention": ctx.attention()[0],
               "engine build s": build, "run s": seconds, "output tok/s": tokens / seconds,
               "total tok/s": (tokens + prompt_tokens) / seconds,
               "workload": f"{len(w['prompts'])} prompts, {prompt_tokens} prompt tokens, {w['new']} new each",
               "kv tokens": placement["kv_cache_tokens"], "batch-1 decode step ms": step_ms,
               "weights GB": weight_bytes(m) / 1e9}  # fmt: skip
    if ctx.cuda:
        bw = bandwidth(ctx)
        limit_ms = 1e3 * weight_bytes(m) / (bw["peak"] or bw["copy"] or float("nan"))
        figures.update({"memory bandwidth GB/s (peak)": bw["peak"] / 1e9, "device copy GB/s": bw["copy"] / 1e9,
                        "weight-bandwidth limit ms": limit_ms, "step / limit": step_ms / limit_ms,
                        "step within 20% of the limit": step_ms <= STEP_TARGET * limit_ms})  # fmt: skip
    return figures
