"""oneDNN-packed copies of a model's linear weights, used by the engine's CPU forwards only.

torch's `F.linear` on the CPU runs near 130 GFLOP/s for a decode step's shapes here, and 65 for a
32k-vocabulary LM head; the same products on weights reordered once into oneDNN's blocked layout run
near 190-200 (fp32; the bf16 gain is smaller). The q/k/v projections, which read one input, share
one packed weight and one product: a 64-row decode step's q/k/v take 201 us instead of 266 in bf16,
389 instead of 484 in fp32 (`benchmarks/cpu_paths.py products`). The members' outputs are views of
the one result. Grouping gate/up measured 7% faster in bf16 but 20% slower in fp32: not done.

`PackedLinears.active()` swaps the packed forwards in for the duration of an engine forward; outside
it the model is untouched and `model.generate` runs its own code and weights. Costs and limits: one
more copy of the linear weights in memory (the engine's `cpu_packed_weights` setting turns packing
off; by default it is on when the copy fits easily). The engine calls `refresh()` when the weights
change (LLMEngine.reset_prefix_cache): a layer whose weight was replaced or changed in place is
packed again. Modules whose `forward` someone already replaced (accelerate's offloading hooks) are
left alone.
Results equal the originals to float rounding, not bit for bit (another summation order).

Compute dtype: a float32 weight is packed as it is; a bfloat16 or float16 one too where oneDNN
multiplies that dtype itself on this CPU (engine/backends/cpu_isa.py: AVX-512 BW/VL/DQ or
AVX-NE-CONVERT for bf16). Elsewhere (an AVX2-only CPU) torch would refuse to pack it and its own
bf16 product runs at a fraction of the float32 speed, so the weight is packed as float32 and its
products run in float32: the input is widened, the output rounded back to the model's dtype. The
packed copy then takes twice the weight's own size.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from engine.backends.cpu_isa import onednn_native

logger = logging.getLogger("cbserve.engine")

PACKABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BATCH_HINT = 64  # oneDNN picks its blocking for about this many rows; any row count works
# sibling linears that read one input: packed together, one product (gate/up: slower in fp32)
GROUPS = (("q_proj", "k_proj", "v_proj"),)


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor: it cannot be changed in place outside inference mode
        return 0


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a weight of `dtype` is packed and multiplied in on this CPU."""
    return dtype if onednn_native(dtype) else torch.float32


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of `weight`, in its compute dtype (a float32 copy when the CPU has no
    native product for the weight's dtype)."""
    with torch.no_grad():
        w = weight.detach()
        compute = compute_dtype(w.dtype)
        try:
            return torch.ops.mkldnn._reorder_linear_weight(w.to(compute), BATCH_HINT)
        except RuntimeError as exc:  # the probe said yes but this torch/oneDNN build says no
            if compute == torch.float32:
                raise
            logger.warning("cbserve: oneDNN cannot pack %s here (%s); packing as float32", compute, exc)
            return torch.ops.mkldnn._reorder_linear_weight(w.float(), BATCH_HINT)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    shape = x.shape
    dtype = x.dtype
    if packed.dtype != dtype:  # a half-precision model on float32-packed weights: widen, round back
        x = x.float()
        bias = None if bias is None else bias.float()
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), packed, bias, "none", [], "")
    return y.view(*shape[:-1], y.shape[-1]).to(dtype)


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

    def swaps(self) -> list[tuple[torch.nn.Module, Callable]]:
        return [(self.module, self.forward)]


class _PackedGroup:
    """Sibling linears that read the same input (q/k/v): one product on their concatenated
    packed weights. The first member's call computes every member's output (views of one tensor);
    the others return theirs when called with that same input tensor, else run `F.linear`."""

    def __init__(self, modules: list[torch.nn.Linear]) -> None:
        self.modules = modules
        self.seen: list[tuple[torch.Tensor, int]] = []
        self.packed: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.splits = [m.out_features for m in modules]
        self.pending_input: torch.Tensor | None = None
        self.pending: list[torch.Tensor | None] = []

    def refresh(self) -> bool:
        seen = [(m.weight, _version(m.weight)) for m in self.modules]
        if len(seen) == len(self.seen) and all(a is b and u == v for (a, u), (b, v) in zip(seen, self.seen)):
            return False
        with torch.no_grad():
            self.packed = _pack(torch.cat([m.weight.detach() for m in self.modules]))
            biases = [m.bias for m in self.modules]
            self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.seen = seen
        return True

    def _first(self, x: torch.Tensor) -> torch.Tensor:
        outputs = list(_packed_linear(x, self.packed, self.bias).split(self.splits, dim=-1))
        self.pending_input, self.pending = x, outputs
        return outputs[0]

    def _member(self, i: int) -> Callable:
        module = self.modules[i]

        def forward(x: torch.Tensor) -> torch.Tensor:
            if x is self.pending_input and self.pending[i] is not None:
                out, self.pending[i] = self.pending[i], None
                if all(p is None for p in self.pending[1:]):
                    self.pending_input, self.pending = None, []
                return out
            return torch.nn.functional.linear(x, module.weight, module.bias)

        return forward

    def swaps(self) -> list[tuple[torch.nn.Module, Callable]]:
        return [(self.modules[0], self._first)] + [(m, self._member(i)) for i, m in enumerate(self.modules) if i]

    def release(self) -> None:
        self.pending_input, self.pending = None, []


def _groups(model: torch.nn.Module) -> list[list[torch.nn.Linear]]:
    """Children that read the same input and can share one packed product."""
    found = []
    for parent in model.modules():
        for names in GROUPS:
            members = [getattr(parent, n, None) for n in names]
            if not all(isinstance(m, torch.nn.Linear) and _linear_ok(m) for m in members):
                continue
            first = members[0]
            if all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
                   and (m.bias is None) == (first.bias is None) for m in members):  # fmt: skip
                found.append(members)
    return found


def packed_bytes(model: torch.nn.Module) -> int:
    """Memory the packed copies would take (in their compute dtype)."""
    return sum(m.weight.numel() * compute_dtype(m.weight.dtype).itemsize for m in model.modules() if _linear_ok(m))


class PackedLinears:
    def __init__(self, model: torch.nn.Module) -> None:
        groups = _groups(model)
        grouped = {id(m) for g in groups for m in g}
        self.groups = [_PackedGroup(g) for g in groups]
        singles = [_PackedLinear(m) for m in model.modules() if _linear_ok(m) and id(m) not in grouped]
        self.layers: list[_PackedLinear | _PackedGroup] = [*self.groups, *singles]
        self.refresh()
        self._swaps = [swap for layer in self.layers for swap in layer.swaps()]

    def __len__(self) -> int:
        return len(self._swaps)

    def refresh(self) -> int:
        """Pack again every weight replaced or changed in place since it was packed; returns how many."""
        return sum(layer.refresh() for layer in self.layers)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        for module, forward in self._swaps:  # straight into __dict__: nn.Module.__setattr__ costs more per step
            module.__dict__["forward"] = forward
        try:
            yield
        finally:
            for module, _ in self._swaps:
                module.__dict__.pop("forward", None)
            for group in self.groups:
                group.release()
