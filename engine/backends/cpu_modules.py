"""oneDNN-packed copies of a model's linear weights, used by the engine's CPU forwards only.

torch's `F.linear` on the CPU runs near 130 GFLOP/s for a decode step's shapes here, and 65 for a
32k-vocabulary LM head; the same products on weights reordered once into oneDNN's blocked layout run
near 190-200 (fp32; the bf16 gain is smaller). Fusing gate/up products and writing C++ silu-mul and
RMSNorm passes was tried too and measured no faster end to end (docs/benchmarks.md): not kept.

`CPUModules.active()` swaps the packed forwards in for the duration of an engine forward; outside it the
model is untouched and `model.generate` runs its own code and weights. Costs and limits: one more
copy of the linear weights in memory (the engine's `cpu_packed_weights` setting turns all of this
off; by default it is on when the copy fits easily). A weight changed in place (an RL trainer's
optimizer step, `load_state_dict`) or replaced is noticed before the next step and packed again.
Modules whose `forward` someone already replaced (accelerate's offloading hooks) are left alone.
Results equal the originals to float rounding, not bit for bit (another summation order).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("cbserve.engine")

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
BATCH_HINT = 64  # oneDNN picks its blocking for about this many rows; any row count works


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor: it cannot be changed in place outside inference mode
        return 0


def _pack(weight: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    shape = x.shape
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), packed, bias, "none", [], "")
    return y.view(*shape[:-1], y.shape[-1])


def _free_forward(m: torch.nn.Module) -> bool:
    return "forward" not in m.__dict__


def _linear_ok(m: torch.nn.Module) -> bool:
    return (
        type(m) is torch.nn.Linear
        and _free_forward(m)
        and m.weight.device.type == "cpu"
        and m.weight.dtype in PACKABLE_DTYPES
        and (m.bias is None or m.bias.dtype == m.weight.dtype)
    )


@dataclass
class _Swap:
    """One module's fast forward, packed from `sources` (weights) and packed again when they change."""

    module: torch.nn.Module
    sources: Callable[[], list[torch.Tensor]]  # the weights this entry was built from, read afresh
    build: Callable[[list[torch.Tensor]], object]  # sources -> packed state
    forward_of: Callable[[object], Callable]  # packed state -> forward
    seen: list = field(default_factory=list)
    state: object = None

    def refresh(self) -> bool:
        ws = self.sources()
        key = [(id(w), _version(w)) for w in ws]
        if key == self.seen:
            return False
        self.seen, self.state = key, self.build(ws)
        return True


def _linear_swap(m: torch.nn.Linear) -> _Swap:
    def forward_of(packed):
        return lambda x: _packed_linear(x, packed, m.bias)

    return _Swap(m, lambda: [m.weight], lambda ws: _pack(ws[0]), forward_of)


def plan(model: torch.nn.Module) -> list[_Swap]:
    """The swaps this model gets: every packable linear layer."""
    return [_linear_swap(m) for m in model.modules() if _linear_ok(m)]


def packed_bytes(model: torch.nn.Module) -> int:
    """Memory the packed copies would take."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if _linear_ok(m))


class CPUModules:
    def __init__(self, model: torch.nn.Module) -> None:
        self.swaps = plan(model)
        self.refresh()

    def refresh(self) -> int:
        """Pack again every weight replaced or changed in place since it was packed; returns how many."""
        stale = sum(s.refresh() for s in self.swaps)
        return stale

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self.refresh():
            logger.info("cbserve: changed weights packed again")
        for s in self.swaps:
            s.module.forward = s.forward_of(s.state)
        try:
            yield
        finally:
            for s in self.swaps:
                s.module.__dict__.pop("forward", None)
