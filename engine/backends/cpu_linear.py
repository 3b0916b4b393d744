"""oneDNN-packed copies of a model's linear weights, used by the engine's CPU forwards only.

torch's `F.linear` on the CPU runs near 130 GFLOP/s for a decode step's shapes here, and 65 for a
32k-vocabulary LM head; the same products on weights reordered once into oneDNN's blocked layout run
near 190-200 (fp32; the bf16 gain is smaller). Fusing gate/up products and writing C++ silu-mul and
RMSNorm passes was tried too and measured no faster end to end (docs/benchmarks.md): not kept.

`PackedLinears.active()` swaps the packed forwards in for the duration of an engine forward; outside
it the model is untouched and `model.generate` runs its own code and weights. Costs and limits: one
more copy of the linear weights in memory (the engine's `cpu_packed_weights` setting turns packing
off; by default it is on when the copy fits easily). The engine calls `refresh()` when the weights
change (LLMEngine.reset_prefix_cache): a layer whose weight was replaced or changed in place is
packed again. Modules whose `forward` someone already replaced (accelerate's offloading hooks) are
left alone.
Results equal the originals to float rounding, not bit for bit (another summation order).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

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


def _linear_ok(m: torch.nn.Module) -> bool:
    return (
        type(m) is torch.nn.Linear
        and "forward" not in m.__dict__  # nobody else's forward is replaced
        and m.weight.device.type == "cpu"
        and m.weight.dtype in PACKABLE_DTYPES
        and (m.bias is None or m.bias.dtype == m.weight.dtype)
    )


@dataclass
class _PackedLinear:
    """One linear layer's packed weight, packed again when the weight is replaced or changed in place."""

    module: torch.nn.Linear
    weight: torch.Tensor | None = None  # the tensor that was packed
    version: int = -1
    packed: torch.Tensor | None = None

    def refresh(self) -> bool:
        w = self.module.weight
        if w is self.weight and _version(w) == self.version:
            return False
        self.weight, self.version, self.packed = w, _version(w), _pack(w)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_linear(x, self.packed, self.module.bias)


def packed_bytes(model: torch.nn.Module) -> int:
    """Memory the packed copies would take."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if _linear_ok(m))


class PackedLinears:
    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = [_PackedLinear(m) for m in model.modules() if _linear_ok(m)]
        self.refresh()

    def __len__(self) -> int:
        return len(self.layers)

    def refresh(self) -> int:
        """Pack again every weight replaced or changed in place since it was packed; returns how many."""
        return sum(layer.refresh() for layer in self.layers)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        for layer in self.layers:  # straight into __dict__: nn.Module.__setattr__ costs more per step
            layer.module.__dict__["forward"] = layer.forward
        try:
            yield
        finally:
            for layer in self.layers:
                layer.module.__dict__.pop("forward", None)
