"""Where the model runs and in which dtype: plain rules over what torch reports.

`probe()` asks torch once; `resolve_device` and `resolve_dtype` take its answer as an argument,
so every rule is tested on any machine by handing them the answer to test (a GPU with or
without bfloat16, no GPU at all). `on_device` makes the model's GPU the current one of whichever
thread runs device work.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Accelerator:
    """What torch sees: CUDA devices, whether they run bfloat16, and the build (for messages)."""

    cuda_available: bool
    device_count: int = 0
    bf16_supported: bool = False
    torch_version: str = torch.__version__
    cuda_build: str | None = None  # torch.version.cuda; None: a CPU-only build of torch
    cpu_bf16_dot: bool = False  # the CPU multiplies bfloat16 pairs itself (AVX-512 BF16 or AMX), as oneDNN uses


def probe() -> Accelerator:
    from engine.backends.cpu_isa import dot_product_instructions

    available = torch.cuda.is_available()
    return Accelerator(
        cuda_available=available,
        device_count=torch.cuda.device_count() if available else 0,
        bf16_supported=bool(available and torch.cuda.is_bf16_supported()),
        cuda_build=torch.version.cuda,
        cpu_bf16_dot=dot_product_instructions(torch.bfloat16),  # CBSERVE_CPU_ISA=avx2 included: no
    )


def resolve_device(requested: str, acc: Accelerator) -> str:
    """"auto": "cuda" when torch sees a GPU, else "cpu". "cuda" or "cuda:N" without one (or without
    device N) is a ValueError saying why, before anything loads."""
    if requested == "auto":
        return "cuda" if acc.cuda_available else "cpu"
    if requested == "cpu":
        return "cpu"
    m = re.fullmatch(r"cuda(?::([0-9]+))?", requested)
    if m is None:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {requested!r}")
    if not acc.cuda_available:
        build = "a CPU-only build" if acc.cuda_build is None else f"built for CUDA {acc.cuda_build}, but it sees no GPU"
        raise ValueError(f"device {requested}: CUDA is not available (torch {acc.torch_version}, {build}); "
                         "use --device cpu, or auto")  # fmt: skip
    if m.group(1) is not None and int(m.group(1)) >= acc.device_count:
        raise ValueError(f"device {requested}: torch sees {acc.device_count} GPU(s), cuda:0 to "
                         f"cuda:{acc.device_count - 1}")  # fmt: skip
    return requested


def resolve_dtype(requested: str, device: str, acc: Accelerator) -> str:
    """"auto": on a GPU bfloat16 where it runs it, else float16; on a CPU bfloat16 where the CPU
    multiplies bfloat16 itself (every path, cbserve's and torch's, is faster than in float32 there:
    docs/benchmarks.md), else float32 (torch's own bfloat16 products are several times slower than
    float32 without those instructions). A named dtype is kept (the attention backend refuses what it
    cannot run, naming it)."""
    if requested != "auto":
        return requested
    if not device.startswith("cuda"):
        return "bfloat16" if acc.cpu_bf16_dot else "float32"
    return "bfloat16" if acc.bf16_supported else "float16"


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """The model's GPU as the calling thread's current CUDA device for the duration (a no-op on any
    other device). torch keeps the current device per thread, and what takes no device argument
    follows it: a CUDA graph's capture stream, `torch.cuda.current_stream()`, new events. Without
    it, a thread working for a model on cuda:1 would capture its graphs on cuda:0."""
    if device.type != "cuda" or device.index is None:
        return contextlib.nullcontext()
    return torch.cuda.device(device)
