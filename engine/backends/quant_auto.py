"""What `quantization: auto` keeps in GGUF blocks, decided at load by timing one matrix of each kind.

Two kinds of weights: `layers` (the decoder layers' linear weights) and `head` (the LM head; with
tied embeddings the token embedding too, on the same bytes). An untied token embedding keeps its
blocks whatever the probe says: a lookup dequantizes only the rows it reads, there is no product.

For each kind, the first `PROBE_ROWS` output rows of its largest matrix are multiplied both ways, as
the engine would run them: by the block kernel (engine/backends/cpu_quant.py's `QuantizedLinear`,
float activations) and dequantized to the model's dtype and packed as the engine packs a dense weight
(engine/backends/cpu_linear.py's `linear_plan`), at 1 input row (one sequence decoding) and at
`BATCH` rows (a decode step of a busy server). A kind keeps its blocks when the block kernel's two
times add up to less than `MARGIN` times the dense path's: a near tie stays dense, which keeps the
native decoder stack and the packed products. The probe runs on one thread, and each time is the
fastest of up to `REPEATS` calls made in turn with the other way's: on a busy machine a thread that
loses its core mid-call makes a multi-threaded call wait for it, and that would decide. It takes
about a tenth of a second.

Memory comes first: a kind goes dense only while the dense weights of every kind made dense fit in
`MEMORY_SHARE` of the host memory the process can still take at load (engine/backends/memory.py's
`host_available_bytes`: psutil's, or a pod's cgroup limit where that is less); past that the kinds
with the most dense bytes keep their blocks whatever the probe timed, and the start-up line says
so. A GGUF file of a model whose float weights do not fit (an 8B Q4_0 file on a 16 GiB machine)
loads in its blocks instead of failing.

With dense decoder layers the engine runs its native decoder stack (engine/backends/cpu_layers.py)
and oneDNN's or cbserve's packed products; weights in blocks give up the packed products for the
block kernel. `quantization: gguf` keeps every Q8_0/Q4_0/Q4_1/Q4_K/Q6_K weight in its blocks (the memory
saving), `none` dequantises them all. `python benchmarks/gguf_native.py kernels` times every shape
both ways.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from types import ModuleType

import torch

from engine.backends.cpu_quant import NAMES, dequantize_rows, linear

logger = logging.getLogger("cbserve.loader")

KINDS = ("layers", "head")
PROBE_ROWS = 2048  # output rows of the probed matrix: larger than a core's L2 in any dtype, so read from further out
BATCH = 16  # input rows of the probe's second size
REPEATS = 20
BUDGET_S = 0.05  # per row count, both ways
MARGIN = 0.9  # blocks must be this much faster in all: a near tie (or a noisy probe) stays dense
MEMORY_SHARE = 0.5  # of the host memory available at load, at most, for the dense weights auto makes


@dataclass(frozen=True)
class Timing:
    """One kind's probe: microseconds of one product at 1 and at BATCH input rows, each way."""

    qtype: int
    shape: tuple[int, int]  # the whole matrix's [out, in]
    blocks_us: tuple[float, float]
    dense_us: tuple[float, float]

    @property
    def keeps_blocks(self) -> bool:
        return sum(self.blocks_us) < MARGIN * sum(self.dense_us)

    def as_dict(self) -> dict:
        return {"type": NAMES[self.qtype], "shape": list(self.shape), "rows": [1, BATCH],
                "blocks_us": [round(t, 1) for t in self.blocks_us], "dense_us": [round(t, 1) for t in self.dense_us]}  # fmt: skip


@dataclass
class BlockChoice:
    """Which kinds keep their blocks, and why: `setting` gguf (all), auto (by `timings`) or none."""

    setting: str
    blocks: dict[str, bool]
    dtype: torch.dtype = torch.float32  # of the dense weights and of everything else
    timings: dict[str, Timing] = field(default_factory=dict)
    for_memory: tuple[str, ...] = ()  # kinds kept in blocks because their dense weights would not fit
    memory_note: str = ""

    @classmethod
    def everywhere(cls, dtype: torch.dtype) -> BlockChoice:
        return cls("gguf", dict.fromkeys(KINDS, True), dtype)

    def keeps(self, kind: str) -> bool:
        return self.blocks.get(kind, True)

    def describe(self) -> str:
        """One line: what is in blocks and what dense, with the probe's times."""
        dtype = str(self.dtype).removeprefix("torch.")
        parts = []
        for kind in KINDS:
            t = self.timings.get(kind)
            if t is None and self.setting == "auto":
                parts.append(f"{kind}: no Q8_0, Q4_0, Q4_1, Q4_K or Q6_K weights")
                continue
            what = f"{NAMES[t.qtype]} blocks" if t and self.keeps(kind) else "blocks" if self.keeps(kind) else f"dense {dtype}"
            times = ""
            if t is not None:
                times = (f" (blocks {t.blocks_us[0]:.0f}+{t.blocks_us[1]:.0f} us against dense {t.dense_us[0]:.0f}+"
                         f"{t.dense_us[1]:.0f} us at 1+{BATCH} rows)")  # fmt: skip
            if kind in self.for_memory:
                times += " kept for memory"
            parts.append(f"{kind} {what}{times}")
        line = f"quantization {self.setting}: " + "; ".join(parts)
        return line + (f" ({self.memory_note})" if self.memory_note else "")

    def as_dict(self) -> dict:
        """What the engine's placement (`GET /v1/models`) shows."""
        out = {"setting": self.setting, "blocks": dict(self.blocks),
               "probe": {k: t.as_dict() for k, t in self.timings.items()}}  # fmt: skip
        if self.for_memory:
            out["kept_for_memory"] = list(self.for_memory)
        return out


def _fastest_us(a, b) -> tuple[float, float]:
    """The fastest of REPEATS calls of `a` and of `b`, called in turn (both see the same moments of the
    machine), in microseconds; stops early after BUDGET_S once each ran three times."""
    a(), b()  # first calls: page faults, oneDNN's primitive creation
    best = [float("inf"), float("inf")]
    start = time.perf_counter()
    for i in range(REPEATS):
        for j, fn in enumerate((a, b)):
            t = time.perf_counter()
            fn()
            best[j] = min(best[j], time.perf_counter() - t)
        if i >= 2 and time.perf_counter() - start > BUDGET_S:
            break
    return best[0] * 1e6, best[1] * 1e6


def measure(blocks: torch.Tensor, qtype: int, shape: tuple[int, int], dtype: torch.dtype, ops: ModuleType) -> Timing:
    """Time the first PROBE_ROWS rows of `blocks` (uint8 [rows, row bytes] of GGUF type `qtype`, of a
    matrix of `shape` [out, in]) both ways at 1 and BATCH input rows of `dtype`."""
    part = blocks[:PROBE_ROWS].contiguous()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(part, qtype, shape, dtype, ops)
    finally:
        torch.set_num_threads(threads)


def _measure(part: torch.Tensor, qtype: int, shape: tuple[int, int], dtype: torch.dtype, ops: ModuleType) -> Timing:
    from engine.backends.cpu_linear import _packed_linear, linear_plan

    k = shape[1]
    like = torch.empty(0, dtype=dtype)
    with torch.no_grad():
        packed = linear_plan(ops).pack(dequantize_rows(ops, part, qtype, k, None, like))
        blocks_us, dense_us = [], []
        for rows in (1, BATCH):
            x = torch.randn(rows, k).to(dtype)
            b, d = _fastest_us(lambda: linear(ops, x, part, qtype, None), lambda: _packed_linear(x, packed, None))
            blocks_us.append(b)
            dense_us.append(d)
    return Timing(qtype, shape, (blocks_us[0], blocks_us[1]), (dense_us[0], dense_us[1]))


def within_memory(blocks: dict[str, bool], dense_bytes: dict[str, int], budget: int) -> tuple[str, ...]:
    """The kinds to keep in blocks, beyond those `blocks` keeps, so that the dense weights of the rest
    fit in `budget` bytes: the largest first."""
    dense = sorted((k for k, keep in blocks.items() if not keep), key=lambda k: -dense_bytes.get(k, 0))
    total = sum(dense_bytes.get(k, 0) for k in dense)
    kept = []
    for kind in dense:
        if total <= budget:
            break
        kept.append(kind)
        total -= dense_bytes.get(kind, 0)
    return tuple(kept)


def choose(samples: dict[str, tuple[torch.Tensor, int, tuple[int, int]]], dtype: torch.dtype,
           ops: ModuleType, dense_bytes: dict[str, int] | None = None,
           available_bytes: int | None = None) -> BlockChoice:  # fmt: skip
    """auto's choice: `samples` maps a kind to its largest matrix (its first PROBE_ROWS rows of blocks,
    its GGUF type, its [out, in] shape); a kind without one (no weight of that kind in a type cbserve
    multiplies in blocks) has nothing to choose. `dense_bytes`: each kind's weights in `dtype`, held
    against MEMORY_SHARE of `available_bytes` (default: the host memory available now)."""
    timings = {kind: measure(b, q, shape, dtype, ops) for kind, (b, q, shape) in samples.items()}
    choice = BlockChoice("auto", {kind: t.keeps_blocks for kind, t in timings.items()}, dtype, timings)
    if dense_bytes:
        if available_bytes is None:
            from engine.backends.memory import host_available_bytes

            available_bytes = host_available_bytes()
        budget = int(MEMORY_SHARE * available_bytes)
        kept = within_memory(choice.blocks, dense_bytes, budget)
        if kept:
            for kind in kept:
                choice.blocks[kind] = True
            wanted = sum(dense_bytes.get(k, 0) for k, t in timings.items() if not t.keeps_blocks)
            choice.for_memory = kept
            choice.memory_note = (f"dense weights of {wanted / 2**30:.1f} GiB would pass {MEMORY_SHARE:.0%} of the "
                                  f"{available_bytes / 2**30:.1f} GiB of memory available")  # fmt: skip
    logger.info("cbserve: %s", choice.describe())
    return choice
