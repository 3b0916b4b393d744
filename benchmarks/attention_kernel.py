"""cbserve's C++ CPU attention kernel alone, on step shapes taken from the workloads of throughput.py.

    python benchmarks/attention_kernel.py                        # the kernel built from this tree
    python benchmarks/attention_kernel.py --compare TAG_A TAG_B  # two builds, alternating processes
    [--block-size 64] [--shapes "prefill W3,prefill 16k"]

Shapes (W1's model: 8 heads, 4 KV heads, head dim 64, blocks of `--block-size` tokens, 16 unless
said, the figures in docs/benchmarks.md before 2026-11-29 among them; random blocks of a cache of
4,096 blocks unless said):
  decode W1         64 decode tokens over 48-287 keys each
  decode W1 cold    the same over a cache 8x as large, a 64 MB buffer written before each call (as in a
                    step, where the layers' weights pass through the caches between calls: the keys
                    and values come from memory)
  decode W2         64 decode tokens over a shared 512-token prefix plus 32-129 keys of their own
  decode long       64 decode tokens over 560-639 keys each, nothing shared
  decode long cold  the same, cold as decode W1 cold
  prefill W1        8 fresh prompts of 16-256 tokens
  prefill W2        24 chunks of 40 queries over 552 keys (a cached 512-token prefix)
  prefill W3        one chunk of 1,024 queries over 1,750 keys
  prefill 16k       one chunk of 512 queries over 16,384 keys (a long document's last chunk)
  decode 16k        8 decode tokens over 16,384 keys each

Prints the median milliseconds per kernel call over the rounds, per dtype. A build is a folder of
the cbserve kernel cache (`python -m engine.backends.cpu_kernels` prints the current one); two builds
cannot be loaded into one process (their symbols clash), so `--compare` alternates processes.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import torch

HEADS, KV_HEADS, DIM, BLOCK = 8, 4, 64, 16


def load_build(tag: str | None):
    from engine.backends.cpu_kernels import cpu_ops, ops_of_build

    return cpu_ops() if tag is None else ops_of_build(tag)


def step(dtype, q_lens, k_lens, shared_prefix=0, cache_scale=1, cold=False, seed=0):
    del cold  # a shape's timing option, read by measure()
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // BLOCK) for n in k_lens)
    num_blocks = max(4096 * cache_scale, len(k_lens) * width + 64)
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=g).to(dtype)
    tables = (torch.randperm(num_blocks - 64, generator=g)[: len(k_lens) * width] + 64).view(len(k_lens), width)
    tables = tables.int().contiguous()
    if shared_prefix:
        tables[:, : shared_prefix // BLOCK] = torch.arange(shared_prefix // BLOCK, dtype=torch.int32)
    q = torch.randn(sum(q_lens), HEADS, DIM, generator=g).to(dtype)
    q_start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, tables, torch.tensor(k_lens, dtype=torch.int32), q_start


def shapes():
    g = torch.Generator().manual_seed(0)
    w1 = torch.randint(48, 288, (64,), generator=g).tolist()
    own = torch.randint(32, 130, (64,), generator=g).tolist()
    long = torch.randint(560, 640, (64,), generator=g).tolist()
    prompts = torch.randint(16, 257, (8,), generator=g).tolist()
    return {
        "decode W1": dict(q_lens=[1] * 64, k_lens=w1),
        "decode W1 cold": dict(q_lens=[1] * 64, k_lens=w1, cache_scale=8, cold=True),
        "decode W2": dict(q_lens=[1] * 64, k_lens=[512 + n for n in own], shared_prefix=512),
        "decode long": dict(q_lens=[1] * 64, k_lens=long),
        "decode long cold": dict(q_lens=[1] * 64, k_lens=long, cache_scale=8, cold=True),
        "prefill W1": dict(q_lens=prompts, k_lens=prompts),
        "prefill W2": dict(q_lens=[40] * 24, k_lens=[552] * 24, shared_prefix=512),
        "prefill W3": dict(q_lens=[1024], k_lens=[1750]),
        "prefill 16k": dict(q_lens=[512], k_lens=[16384]),
        "decode 16k": dict(q_lens=[1] * 8, k_lens=[16384] * 8),
    }


def chosen(names: str | None) -> dict:
    every = shapes()
    if not names:
        return every
    wanted = [n.strip() for n in names.split(",")]
    unknown = [n for n in wanted if n not in every]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {list(every)}")
    return {n: every[n] for n in wanted}


def measure(tag: str | None, rounds: int, names: str | None = None) -> None:
    ops = load_build(tag)
    name = tag or "current"
    evict = torch.zeros(16 << 20)  # 64 MB, twice the L3 of the machine
    for dtype in (torch.float32, torch.bfloat16):
        for label, shape in chosen(names).items():
            q, k_cache, v_cache, tables, k_lens, q_start = step(dtype, **shape)
            out = torch.empty_like(q)
            calls = 20 if shape["q_lens"][0] == 1 else 3
            times = []
            for i in range(rounds + 1):
                elapsed = 0.0
                for _ in range(calls):
                    if shape.get("cold"):
                        evict.add_(1.0)  # the caches now hold this, not the step's keys and values
                    t0 = time.perf_counter()
                    ops.paged_attention(out, q, k_cache, v_cache, tables, k_lens, q_start, DIM**-0.5, 0)
                    elapsed += time.perf_counter() - t0
                if i:  # the first round warms up
                    times.append(elapsed / calls)
            print(f"{name}\t{str(dtype)[6:]}\t{label}\t{1e3 * statistics.median(times):.3f}", flush=True)


def compare(tags: list[str], rounds: int, processes: int, extra: list[str], names: str | None) -> None:
    results: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for _ in range(processes):
        for tag in tags:
            out = subprocess.run([sys.executable, __file__, "--build", tag, "--rounds", str(rounds), *extra],
                                 check=True, capture_output=True, text=True).stdout  # fmt: skip
            for line in out.splitlines():
                name, dtype, label, ms = line.split("\t")
                results[(dtype, label, name)].append(float(ms))
    print(f"median ms per call over {processes} alternating processes ({rounds} rounds each)")
    print(f"{'dtype':9s} {'shape':16s} " + " ".join(f"{t:>14s}" for t in tags) + "   last/first")
    for dtype in ("float32", "bfloat16"):
        for label in chosen(names):
            ms = [statistics.median(results[(dtype, label, t)]) for t in tags]
            print(f"{dtype:9s} {label:16s} " + " ".join(f"{m:14.3f}" for m in ms) + f"   {ms[-1] / ms[0]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", help="a kernel cache folder name (default: this tree's build)")
    parser.add_argument("--compare", nargs="+", metavar="TAG", help="builds to alternate, in processes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--processes", type=int, default=4, help="with --compare: processes per build")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (the CPU default is 64)")
    parser.add_argument("--shapes", help="comma-separated shape names (default: all)")
    args = parser.parse_args()
    global BLOCK
    BLOCK = args.block_size
    if args.compare:
        extra = ["--block-size", str(args.block_size)] + (["--shapes", args.shapes] if args.shapes else [])
        compare(args.compare, args.rounds, args.processes, extra, args.shapes)
    else:
        measure(args.build, args.rounds, args.shapes)


if __name__ == "__main__":
    main()
