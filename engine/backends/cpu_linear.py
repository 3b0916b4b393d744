"""Packed copies of a model's linear weights, used by the engine's CPU forwards only.

Two packed layouts, each made once from the weight:
- **Panels** (engine/csrc/linear_cpu.cpp, with cbserve's C++ kernels): the weight cut into panels
  of two vectors' worth of outputs, in the weight's own dtype (a bfloat16 model's panels take half a
  float32 copy's memory and are widened on load), multiplied by a kernel that keeps a block of sums
  in registers. `python benchmarks/cpu_paths.py products` compares it with oneDNN's packed product
  on the host at hand (figures in docs/benchmarks.md).
- **oneDNN's blocked layout** (`torch.ops.mkldnn`), in the compute dtype below.

`linear_plan(ops)` decides which a model gets. With kernels built for AVX2: panels only. With
kernels built for AVX-512: panels for steps of up to `PANEL_ROWS` rows and oneDNN above, except for
weights in a dtype the CPU has dot-product instructions for (bf16 with AVX-512 BF16): those go to
oneDNN alone, which multiplies the pairs into float32 sums where the panels widen each value first
(docs/benchmarks.md compares the two on the hosts measured). Without the kernels
(`CBSERVE_CPU_KERNELS=0`, no compiler): oneDNN only.

The q/k/v projections, which read one input, share one packed weight and one product; the
members' outputs are views of the one result. Grouping gate/up measured 7% faster in bf16 but 20%
slower in fp32 on oneDNN: not done.

`PackedLinears.active()` swaps the packed forwards in for the duration of an engine forward; outside
it the model is untouched and `model.generate` runs its own code and weights. Costs and limits: one
or two more copies of the linear weights in memory (`packed_bytes`; the engine's
`cpu_packed_weights` setting turns packing off, and by default it is on when the copies fit easily).
The engine calls `refresh()` when the weights change (LLMEngine.reset_prefix_cache): a layer whose
weight was replaced or changed in place is packed again. Modules whose `forward` someone already
replaced (accelerate's offloading hooks) are left alone. Results equal the originals to float
rounding, not bit for bit (another summation order).

oneDNN's compute dtype: a float32 weight is packed as it is; a bfloat16 or float16 one too where
oneDNN multiplies that dtype itself on this CPU (engine/backends/cpu_isa.py: AVX-512 BW/VL/DQ or
AVX-NE-CONVERT for bf16). Elsewhere (an AVX2-only CPU) torch would refuse to pack it, so it is packed
as float32 and its products run in float32: the input is widened, the output rounded back to the
model's dtype.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import torch

from engine.backends.cpu_isa import dot_product_instructions, onednn_native

logger = logging.getLogger("cbserve.engine")

PACKABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BATCH_HINT = 64  # oneDNN picks its blocking for about this many rows; any row count works
PANEL_ROWS = 64  # with both layouts, products of up to this many rows run on the panels
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


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of `weight`, in its compute dtype (a float32 copy when the CPU has no
    native product for the weight's dtype)."""
    w = weight.detach()
    compute = compute_dtype(w.dtype)
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.to(compute), BATCH_HINT)
    except RuntimeError as exc:  # the probe said yes but this torch/oneDNN build says no
        if compute == torch.float32:
            raise
        logger.warning("cbserve: oneDNN cannot pack %s here (%s); packing as float32", compute, exc)
        return torch.ops.mkldnn._reorder_linear_weight(w.float(), BATCH_HINT)


class PackedWeight(NamedTuple):
    out_features: int
    panels: torch.Tensor | None  # cbserve's panels (engine/csrc/linear_cpu.cpp), in the weight's dtype
    onednn: torch.Tensor | None  # oneDNN's blocked layout, in compute_dtype(weight.dtype)
    ops: ModuleType | None  # the kernels that multiply the panels
    panel_rows: int  # with both layouts: up to this many rows on the panels


@dataclass(frozen=True)
class LinearPlan:
    """Which packed layouts a weight gets (see the module's docstring)."""

    ops: ModuleType | None = None  # cbserve's C++ kernels: panels when set
    onednn: bool = True
    panel_rows: int = PANEL_ROWS

    def __post_init__(self) -> None:
        if self.ops is None and not self.onednn:
            raise ValueError("a linear plan needs panels (cbserve's kernels) or oneDNN")

    def panels_for(self, dtype: torch.dtype) -> bool:
        """Whether weights of `dtype` get panels: not where oneDNN has the CPU's dot products for it."""
        return self.ops is not None and not (self.onednn and dot_product_instructions(dtype))

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        ops = self.ops if self.panels_for(weight.dtype) else None
        with torch.no_grad():
            panels = ops.pack_linear_weight(weight.detach()) if ops is not None else None
            onednn = _onednn_pack(weight) if self.onednn else None
        return PackedWeight(weight.shape[0], panels, onednn, ops, self.panel_rows)

    def nbytes(self, weight: torch.Tensor) -> int:
        size = weight.numel() * weight.dtype.itemsize if self.panels_for(weight.dtype) else 0
        return size + (weight.numel() * compute_dtype(weight.dtype).itemsize if self.onednn else 0)

    def describe(self, dtype: torch.dtype = torch.float32) -> str:
        """The layouts a `dtype` model's weights get, and the dtype of oneDNN's products."""
        products = f"({str(compute_dtype(dtype)).removeprefix('torch.')} products)"
        if self.ops is None:
            return f"oneDNN-packed weights {products}"
        if not self.onednn:
            return "cbserve's panel kernel"
        if not self.panels_for(dtype):
            return f"oneDNN-packed weights alone {products}: the CPU has dot-product instructions for them"
        return (f"cbserve's panel kernel (steps of up to {self.panel_rows} rows), "
                f"oneDNN-packed weights above {products}")


def linear_plan(ops: ModuleType | None) -> LinearPlan:
    """This host's plan: panels alone under an AVX2 build of the kernels, panels for decode steps and
    oneDNN for prompt steps under an AVX-512 one, oneDNN alone without the kernels."""
    if ops is None:
        return LinearPlan()
    return LinearPlan(ops=ops, onednn=ops.lanes() == 16 and packing_available())


def _packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if packed.panels is not None and (packed.onednn is None or x2.shape[0] <= packed.panel_rows):
        y = packed.ops.packed_linear(x2, packed.panels, bias, packed.out_features)
        return y.view(*shape[:-1], packed.out_features)
    dtype = x.dtype
    if packed.onednn.dtype != dtype:  # a half-precision model on float32-packed weights: widen, round back
        x2 = x2.float()
        bias = None if bias is None else bias.float()
    y = torch.ops.mkldnn._linear_pointwise(x2, packed.onednn, bias, "none", [], "")
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
    plan: LinearPlan
    weight: torch.Tensor | None = None  # the tensor that was packed
    version: int = -1
    packed: PackedWeight | None = None

    def refresh(self) -> bool:
        w = self.module.weight
        if w is self.weight and _version(w) == self.version:
            return False
        self.weight, self.version, self.packed = w, _version(w), self.plan.pack(w)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_linear(x, self.packed, self.module.bias)

    def swaps(self) -> list[tuple[torch.nn.Module, Callable]]:
        return [(self.module, self.forward)]


class _PackedGroup:
    """Sibling linears that read the same input (q/k/v): one product on their concatenated
    packed weights. The first member's call computes every member's output (views of one tensor);
    the others return theirs when called with that same input tensor, else run `F.linear`."""

    def __init__(self, modules: list[torch.nn.Linear], plan: LinearPlan) -> None:
        self.modules = modules
        self.plan = plan
        self.seen: list[tuple[torch.Tensor, int]] = []
        self.packed: PackedWeight | None = None
        self.bias: torch.Tensor | None = None
        self.splits = [m.out_features for m in modules]
        self.pending_input: torch.Tensor | None = None
        self.pending: list[torch.Tensor | None] = []

    def refresh(self) -> bool:
        seen = [(m.weight, _version(m.weight)) for m in self.modules]
        if len(seen) == len(self.seen) and all(a is b and u == v for (a, u), (b, v) in zip(seen, self.seen)):
            return False
        with torch.no_grad():
            self.packed = self.plan.pack(torch.cat([m.weight.detach() for m in self.modules]))
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


def packed_bytes(model: torch.nn.Module, plan: LinearPlan) -> int:
    """Memory the packed copies would take."""
    return sum(plan.nbytes(m.weight) for m in model.modules() if _linear_ok(m))


class PackedLinears:
    def __init__(self, model: torch.nn.Module, plan: LinearPlan | None = None) -> None:
        self.plan = plan = plan or LinearPlan()
        groups = _groups(model)
        grouped = {id(m) for g in groups for m in g}
        self.groups = [_PackedGroup(g, plan) for g in groups]
        singles = [_PackedLinear(m, plan) for m in model.modules() if _linear_ok(m) and id(m) not in grouped]
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
