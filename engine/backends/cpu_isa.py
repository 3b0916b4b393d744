"""What this CPU can do, asked once, and the answers every CPU fast path goes by.

Hosts differ (a laptop, a CPU node, AVX2-only or AVX-512 server CPUs), so no fast path assumes an
instruction set. Three answers come from one probe of the CPU's
flags (/proc/cpuinfo on Linux):

- `kernel_isa()`: which build of cbserve's C++ kernels runs here. "avx512" (AVX-512 F/BW/VL/DQ:
  16 float lanes a register), "avx2" (AVX2, FMA and F16C: 8 lanes), or None (no such x86-64 CPU:
  the torch path).
- `onednn_native(dtype)`: whether oneDNN packs and multiplies this dtype itself. bfloat16 needs
  AVX-512 BW/VL/DQ or AVX-NE-CONVERT (torch refuses to pack it otherwise); float16 needs
  AVX-512-FP16 or AVX-NE-CONVERT. Where it cannot, cbserve packs such weights as float32 and
  computes those products in float32 (engine/backends/cpu_linear.py).

`CBSERVE_CPU_ISA` forces the answer downwards, for tests and for emulating a smaller CPU on a larger
one: `avx2` makes an AVX-512 host take every AVX2 path (kernels built for x86-64-v3, bf16 products
in float32); `none` turns the kernels off (as `CBSERVE_CPU_KERNELS=0` does). Asking for more than
the CPU has (`avx512` on an AVX2 host) is refused with an error that says what the CPU lacks.
`describe()` is the one line that names the CPU and the paths; the engine logs it and
benchmarks/throughput.py prints it.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger("cbserve.engine")

ENV = "CBSERVE_CPU_ISA"
ISAS = ("avx512", "avx2")  # best first
NEEDS = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
}
# flags named in describe(): the ones the code above asks about, and VNNI (engine/csrc/quant_cpu.cpp's integer dots)
SHOWN = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_fp16",
         "avx512_vnni", "avx_vnni", "avx_ne_convert", "amx_bf16")  # fmt: skip


@dataclass(frozen=True)
class CpuInfo:
    model: str = "unknown CPU"
    family: str = "?"
    model_number: str = "?"
    flags: frozenset[str] = field(default_factory=frozenset)
    x86: bool = True

    def best_isa(self) -> str | None:
        if not self.x86:
            return None
        return next((isa for isa in ISAS if NEEDS[isa] <= self.flags), None)


def read_cpu() -> CpuInfo:
    """The host's CPU: model name, family and flags, from /proc/cpuinfo where there is one."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if not key and fields:  # the first processor's block is enough
                break
            fields.setdefault(key, value.strip())
    except OSError:
        pass
    return CpuInfo(
        model=fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU",
        family=fields.get("cpu family", "?"),
        model_number=fields.get("model", "?"),
        flags=frozenset(fields.get("flags", "").split()),
        x86=x86,
    )


def resolve_isa(cpu: CpuInfo, forced: str | None) -> str | None:
    """The kernel ISA for `cpu` given the `CBSERVE_CPU_ISA` value (None/"" or "auto": the best it has)."""
    best = cpu.best_isa()
    forced = (forced or "auto").strip().lower()
    if forced == "auto":
        return best
    if forced == "none":
        return None
    if forced not in ISAS:
        raise ValueError(f"{ENV}={forced}: expected one of auto, {', '.join(ISAS)}, none")
    if best is None or ISAS.index(forced) < ISAS.index(best):
        missing = sorted(NEEDS[forced] - cpu.flags) or ["an x86-64 CPU"]
        raise ValueError(
            f"{ENV}={forced}: this CPU ({cpu.model}) lacks {', '.join(missing)}; "
            f"it can run {best or 'no kernel ISA'} (set {ENV}=auto, or a smaller ISA)"
        )
    return forced


def native_dtypes(cpu: CpuInfo, emulate_avx2: bool = False) -> frozenset[torch.dtype]:
    """Dtypes oneDNN packs and multiplies natively on `cpu` (float32 always; with `emulate_avx2`,
    what an AVX2-only CPU has: float32 alone)."""
    f = cpu.flags
    out = {torch.float32}
    if cpu.x86 and not emulate_avx2:
        if {"avx512bw", "avx512vl", "avx512dq"} <= f or "avx_ne_convert" in f:
            out.add(torch.bfloat16)
        if "avx512_fp16" in f or "avx_ne_convert" in f:
            out.add(torch.float16)
    return frozenset(out)


@dataclass(frozen=True)
class Capabilities:
    cpu: CpuInfo
    kernel_isa: str | None
    onednn_dtypes: frozenset[torch.dtype]
    forced: str | None

    def describe(self) -> str:
        flags = " ".join(f for f in SHOWN if f in self.cpu.flags) or "none of the flags cbserve uses"
        forced = f", forced by {ENV}={self.forced}" if self.forced else ""
        kernels = f"{self.kernel_isa} kernels" if self.kernel_isa else "no C++ kernels"
        native = ", ".join(str(d).removeprefix("torch.") for d in sorted(self.onednn_dtypes, key=str))
        return f"{self.cpu.model} (family {self.cpu.family} model {self.cpu.model_number}; {flags}): {kernels}{forced}; oneDNN native {native}"


@functools.cache
def capabilities() -> Capabilities:
    """The probe's answers for this process (read once; tests build `Capabilities` from fake CPUs)."""
    cpu = read_cpu()
    forced = os.environ.get(ENV) or None
    isa = resolve_isa(cpu, forced)
    emulate = isa == "avx2" and cpu.best_isa() == "avx512"
    caps = Capabilities(cpu, isa, native_dtypes(cpu, emulate), forced if forced not in (None, "auto") else None)
    # one line: a warning where the CPU has no kernel ISA (an old or non-x86 CPU: the slow torch
    # paths), information otherwise (CBSERVE_CPU_ISA=none included: asked for)
    level = logging.WARNING if isa is None and forced != "none" else logging.INFO
    logger.log(level, "cbserve CPU: %s", caps.describe())
    return caps


def kernel_isa() -> str | None:
    return capabilities().kernel_isa


def onednn_native(dtype: torch.dtype) -> bool:
    return dtype in capabilities().onednn_dtypes


# instructions that multiply-add a dtype's pairs straight into float32 sums (AVX-512 BF16's
# vdpbf16ps, AMX); with them oneDNN's bf16 product does twice a float32 product's work per cycle
DOT_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def dot_product_instructions(dtype: torch.dtype, cpu: CpuInfo | None = None) -> bool:
    """Whether oneDNN multiplies `dtype` with the CPU's own dot-product instructions for it (not by
    widening each value to float32 first, as cbserve's panel kernel does)."""
    if cpu is None:
        caps = capabilities()
        cpu, native = caps.cpu, caps.onednn_dtypes  # CBSERVE_CPU_ISA=avx2 emulation included
    else:
        native = native_dtypes(cpu)
    return dtype in native and any(f in cpu.flags for f in DOT_FLAGS.get(dtype, ()))
