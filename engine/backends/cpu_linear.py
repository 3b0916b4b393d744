"""oneDNN-packed copies of a model's linear weights, used by the engine's CPU forwards only.

torch's `F.linear` on the CPU runs near 130 GFLOP/s for the shapes of a decode step here, and 65 for
a 32k-vocabulary LM head; the same products on weights reordered once into oneDNN's blocked layout
run near 190-200 (fp32; the bf16 gain is smaller). `PackedLinears` keeps one packed copy per
`nn.Linear` and swaps it in for the duration of an engine forward (`with packed.active(): ...`);
outside that, the model is untouched and `model.generate` runs its own weights.

Costs and limits: one more copy of the linear weights in memory (the engine's `cpu_packed_weights`
setting turns it off; by default it is on when the copy fits easily); a weight changed in place
(an RL trainer's optimizer step, `load_state_dict`) is noticed by its version counter and packed
again before the next step. Modules whose `forward` someone already replaced (accelerate's
offloading hooks) keep it and are not packed. Results equal `F.linear` to float rounding, not bit
for bit: a different summation order.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

logger = logging.getLogger("cbserve.engine")

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
BATCH_HINT = 64  # oneDNN picks its blocking for about this many rows; any row count works


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@dataclass
class _Packed:
    module: torch.nn.Linear
    weight: torch.Tensor  # the parameter that was packed
    version: int
    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.packed, self.module.bias, "none", [], "")
        return y.view(*shape[:-1], y.shape[-1])


def _pack(weight: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor: it cannot be changed in place outside inference mode
        return 0


def packable(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [
        m
        for m in model.modules()
        if type(m) is torch.nn.Linear
        and "forward" not in m.__dict__
        and m.weight.device.type == "cpu"
        and m.weight.dtype in PACKABLE_DTYPES
        and (m.bias is None or m.bias.dtype == m.weight.dtype)
    ]


def packed_bytes(model: torch.nn.Module) -> int:
    """Memory the packed copies would take."""
    return sum(m.weight.numel() * m.weight.element_size() for m in packable(model))


class PackedLinears:
    def __init__(self, model: torch.nn.Module) -> None:
        self.entries = [_Packed(m, m.weight, _version(m.weight), _pack(m.weight)) for m in packable(model)]

    def refresh(self) -> int:
        """Pack again every weight replaced or changed in place since it was packed; returns how many."""
        stale = 0
        for e in self.entries:
            w = e.module.weight
            if w is not e.weight or _version(w) != e.version:
                e.weight, e.version, e.packed = w, w._version, _pack(w)
                stale += 1
        if stale:
            logger.info("cbserve: %d changed linear weights packed again", stale)
        return stale

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        self.refresh()
        for e in self.entries:
            e.module.forward = e.forward
        try:
            yield
        finally:
            for e in self.entries:
                e.module.__dict__.pop("forward", None)
