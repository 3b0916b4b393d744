"""The host's limits a decode step is held against: memory bandwidth and the matrix-product peak.

    python benchmarks/machine_limits.py [--threads N] [--array-mib M] [--repeats 10] [--matmul-n 4096]
                                        [--json]

Memory bandwidth as STREAM measures it: float64 arrays each at least four times the last-level
cache (read from /sys; capped at a sixth of the free memory), `copy` (a = b) counted as 2 arrays
x 8 bytes per element and `triad` (a = b + s*c, one fused torch.add) as 3 x 8, best of --repeats,
on all cores through torch's threads (--threads to pick). The product peak: the faster of
torch.matmul and oneDNN's packed product (the one cbserve's linear layers use above its panel
kernel's rows; torch.matmul's float32 goes to MKL, which on an AMD CPU takes its AVX2 path: 197
against oneDNN's 441 GFLOP/s on a Zen 5) of two n x n matrices, 2 n^3 flops, best of --repeats,
in float32 and in bfloat16, the source named; the bf16 line
says whether the CPU multiplies bf16 with its own dot-product instructions (AVX-512 BF16, AMX) or
oneDNN emulates them (then at half n, at most 512: an emulated product ran at about 1 GFLOP/s on
an AVX2-only Zen 3 with torch 2.13, where n = 2048 took minutes). And the 8-bit product peak: two
n x n int8 matrices into int32 (torch._int_mm, oneDNN's 8-bit dot products: VNNI's vpdpbusd where the
CPU has it, else vpmaddubsw), in GOP/s (2 a multiply-add): the floor of a step whose weights and inputs
are both 8-bit (cbserve's GGUF blocks with --quantized-activations int8, llama.cpp's quantized dot
products).

`step_bounds` turns the figures into the least time a decode step can take: the weights it reads
over the bandwidth, and 2 x params x tokens flops over the peak. benchmarks/throughput.py prints
each system's step beside both.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine.backends.cpu_isa import capabilities, dot_product_instructions
from engine.backends.cpu_linear import BATCH_HINT, packing_available

MIB = 1 << 20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Limits:
    host: str  # capabilities().describe()
    threads: int
    array_mib: float  # each of the STREAM arrays
    copy_gbs: float
    triad_gbs: float
    peak_gflops: dict[str, float]  # the faster product, by dtype name
    native: dict[str, bool]  # whether the CPU has dot-product instructions for the dtype
    matmul_n: dict[str, int]
    peak_source: dict[str, str] = field(default_factory=dict)  # "torch.matmul" or "oneDNN packed", by dtype name
    int8_gops: float | None = None  # the 8-bit product (int8_gops); None: not measured

    def peak(self, dtype: str) -> float:
        """The product peak a `dtype` model can reach: its own, or float32's where that is faster (any
        CPU can widen bf16 weights and multiply them in float32)."""
        return max(self.peak_gflops.get(dtype, 0.0), self.peak_gflops["float32"])


@dataclass(frozen=True)
class StepBounds:
    weights_s: float  # the weights read once, at the triad bandwidth
    compute_s: float  # 2 flops per parameter per token, at the product peak

    @property
    def bound_s(self) -> float:
        return max(self.weights_s, self.compute_s)


def step_bounds(params: int, weight_bytes: int, tokens: float, bandwidth_gbs: float,
                peak_gflops: float) -> StepBounds:  # fmt: skip
    """The least time of one step that runs `tokens` tokens (a decode batch: one per sequence)
    through a model of `params` parameters held in `weight_bytes`: reading every weight once, and
    multiplying every weight with every token. Attention and the KV cache are left out, so both are
    floors."""
    return StepBounds(weight_bytes / (bandwidth_gbs * 1e9), 2 * params * tokens / (peak_gflops * 1e9))


def weights_read(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters, bytes) a forward step reads in full: all of them but an input embedding that is
    not also the LM head (a lookup reads only its tokens' rows)."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embedding
    read = [p for p in model.parameters() if tied or p is not embedding]
    return sum(p.numel() for p in read), sum(p.numel() * p.element_size() for p in read)


def last_level_cache_bytes() -> int:
    """The largest cache of cpu0, from /sys (32 MiB where it says nothing)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": MIB, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 * MIB)


def available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_array_mib() -> float:
    """Four times the last-level cache (at least 64 MiB), or a sixth of the free memory if less."""
    size = max(4 * last_level_cache_bytes(), 64 * MIB)
    free = available_bytes()
    if free is not None:
        size = min(size, free // 6)
    return size / MIB


def best_time(fn, repeats: int) -> float:
    fn()  # first touch of the pages, oneDNN's first call
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def stream(array_mib: float, repeats: int) -> tuple[float, float]:
    """(copy, triad) GB/s over float64 arrays of `array_mib` MiB each."""
    n = max(1, int(array_mib * MIB) // 8)
    a, b, c = torch.zeros(n, dtype=torch.float64), torch.full((n,), 1.0, dtype=torch.float64), torch.full(
        (n,), 2.0, dtype=torch.float64)  # fmt: skip
    copy_s = best_time(lambda: a.copy_(b), repeats)
    triad_s = best_time(lambda: torch.add(b, c, alpha=3.0, out=a), repeats)
    if a[n // 2].item() != 7.0:  # a = b + 3c
        raise RuntimeError(f"triad computed {a[n // 2].item()}, not 7")
    return 2 * 8 * n / copy_s / 1e9, 3 * 8 * n / triad_s / 1e9


EMULATED_MAX_N = 512  # emulated bf16 at ~1 GFLOP/s (AVX2 Zen 3, torch 2.13): n = 2048 took 17 s a call


def matmul_size(native: bool, n: int) -> int:
    """The n of a dtype's product: --matmul-n where the CPU has the dtype's dot products, else half of it
    and at most EMULATED_MAX_N, so an emulated product ends in seconds."""
    return n if native else max(16, min(n // 2, EMULATED_MAX_N))


def matmul_gflops(dtype: torch.dtype, n: int, repeats: int, packed: bool = False) -> float:
    """GFLOP/s of an n x n x n product: torch.matmul, or with `packed` oneDNN's product on a weight
    packed in its blocked layout, packed and called as engine/backends/cpu_linear.py does."""
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(n, n, generator=g).to(dtype) for _ in range(2))
    if packed:
        w = torch.ops.mkldnn._reorder_linear_weight(y, BATCH_HINT)
        seconds = best_time(lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), repeats)
        return 2 * n**3 / seconds / 1e9
    out = torch.empty(n, n, dtype=dtype)
    return 2 * n**3 / best_time(lambda: torch.matmul(x, y, out=out), repeats) / 1e9


def product_peak(dtype: torch.dtype, n: int, repeats: int, native: bool) -> tuple[float, str]:
    """The faster of torch.matmul and oneDNN's packed product (where torch has packing and the CPU
    multiplies the dtype itself: oneDNN's emulated bf16 is slower still), with its name."""
    figures = {"torch.matmul": matmul_gflops(dtype, n, repeats)}
    if native and packing_available():
        try:
            figures["oneDNN packed"] = matmul_gflops(dtype, n, repeats, packed=True)
        except RuntimeError as exc:  # this torch/oneDNN build cannot pack the dtype
            print(f"machine_limits: oneDNN's packed {dtype} product not measured ({exc})", file=sys.stderr)
    source = max(figures, key=figures.__getitem__)
    return figures[source], source


def int8_gops(n: int, repeats: int) -> float | None:
    """GOP/s (2 a multiply-add) of an n x n x n product of int8 matrices into int32 (torch._int_mm),
    or None where this torch has no CPU int8 product."""
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(-127, 128, (n, n), generator=g, dtype=torch.int8) for _ in range(2))
    try:
        seconds = best_time(lambda: torch._int_mm(x, y), repeats)
    except (AttributeError, RuntimeError, NotImplementedError) as exc:
        print(f"machine_limits: the int8 product not measured ({exc})", file=sys.stderr)
        return None
    return 2 * n**3 / seconds / 1e9


def measure(threads: int | None = None, array_mib: float | None = None, repeats: int = 10,
            matmul_n: int = 4096) -> Limits:  # fmt: skip
    """The host's limits with `threads` torch threads (default: what torch has now)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        array_mib = array_mib or default_array_mib()
        copy_gbs, triad_gbs = stream(array_mib, repeats)
        native = {name: name == "float32" or dot_product_instructions(dtype) for name, dtype in DTYPES.items()}
        sizes = {name: matmul_size(native[name], matmul_n) for name in DTYPES}
        peaks = {name: product_peak(dtype, sizes[name], max(1, repeats // 2), native[name])
                 for name, dtype in DTYPES.items()}  # fmt: skip
        return Limits(capabilities().describe(), torch.get_num_threads(), array_mib, copy_gbs, triad_gbs,
                      {name: p[0] for name, p in peaks.items()}, native, sizes,
                      {name: p[1] for name, p in peaks.items()},
                      int8_gops(matmul_n, max(1, repeats // 2)))  # fmt: skip
    finally:
        torch.set_num_threads(before)


def describe(limits: Limits) -> str:
    lines = [f"host: {limits.host}", f"torch threads: {limits.threads}",
             f"memory bandwidth (STREAM, float64, 3 arrays of {limits.array_mib:,.0f} MiB, best of the repeats):",
             f"  copy   a = b        {limits.copy_gbs:8.1f} GB/s",
             f"  triad  a = b + s*c  {limits.triad_gbs:8.1f} GB/s",
             "matrix product peak (the faster of torch.matmul and oneDNN's packed product, n x n, 2 n^3 flops, "
             "best of the repeats):"]  # fmt: skip
    for name, gflops in limits.peak_gflops.items():
        how = [limits.peak_source[name]] if name in limits.peak_source else []
        if name != "float32":
            how.append("the CPU's bf16 dot-product instructions" if limits.native[name]
                       else "emulated: no bf16 dot-product instructions on this CPU; a smaller n")  # fmt: skip
        note = f" ({'; '.join(how)})" if how else ""
        lines.append(f"  {name:<9} n={limits.matmul_n[name]:<6}{gflops:8.1f} GFLOP/s{note}")
    n = limits.matmul_n["float32"]
    lines.append(f"  {'int8':<9} n={n:<6}{limits.int8_gops:8.1f} GOP/s (torch._int_mm: 8-bit products into int32)"
                 if limits.int8_gops else "  int8      not measured (no CPU int8 product in this torch)")  # fmt: skip
    return "\n".join(lines)


def load(path: str) -> Limits:
    return Limits(**json.loads(Path(path).read_text()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    parser.add_argument("--array-mib", type=float, help="MiB per STREAM array (default: 4x the last-level cache)")
    parser.add_argument("--repeats", type=int, default=10, help="best of this many (the products: half as many)")
    parser.add_argument("--matmul-n", type=int, default=4096)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON (throughput.py --limits)")
    args = parser.parse_args(argv)
    limits = measure(args.threads, args.array_mib, args.repeats, args.matmul_n)
    print(json.dumps(asdict(limits), indent=2) if args.json else describe(limits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
