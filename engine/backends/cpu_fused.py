"""Fused CPU passes for the RMSNorm, rotary embedding and gated MLP of transformers' Llama family.

transformers' `LlamaRMSNorm` runs seven torch ops per call (a float32 copy, pow, mean, add, rsqrt,
two products and casts), `apply_rotary_pos_emb` twelve (products, negations, concatenations, sums)
and `LlamaMLP` two between its linear layers; on the CPU each op is its own pass over memory and its
own dispatch. cbserve's C++ passes (engine/csrc/elementwise_cpu.cpp) do each in one pass, with the
same roundings (rotary bit for bit; RMSNorm and SiLU to the last bit of a sum or an exp).

Code is swapped only where it is, bytecode for bytecode, transformers' Llama code (Qwen2, Mistral
and many more copy it verbatim): a norm module's `forward`, an MLP's `forward` when its activation
is SiLU, a modeling file's `apply_rotary_pos_emb` (with its `rotate_half`). Anything else (Gemma's
`1 + weight` norm, a LayerNorm, GELU, partial rotary) keeps its own code, and each fused call falls
back to the original for inputs it does not take. Like the packed linears, the swaps are in place
only during the engine's own forwards: `model.generate` outside them runs transformers' code.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from types import ModuleType

import torch
from transformers.activations import SiLUActivation
from transformers.models.llama import modeling_llama as llama

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _same_code(fn: object, reference: Callable) -> bool:
    a, b = getattr(fn, "__code__", None), reference.__code__
    return a is not None and (a.co_code, a.co_consts, a.co_names) == (b.co_code, b.co_consts, b.co_names)


def _norm_forward(module: torch.nn.Module, ops: ModuleType) -> Callable | None:
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", None)
    if not (
        _same_code(type(module).forward, llama.LlamaRMSNorm.forward)
        and isinstance(weight, torch.Tensor)
        and isinstance(eps, float)
    ):
        return None
    original = type(module).forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        w = module.weight  # read per call: a replaced weight is used at once
        if x.dtype != w.dtype or x.dtype not in FUSED_DTYPES or not x.is_contiguous() or x.device.type != "cpu":
            return original(module, x)
        return ops.rms_norm(x, w, eps)

    return forward


def _mlp_forward(module: torch.nn.Module, ops: ModuleType) -> Callable | None:
    act = getattr(module, "act_fn", None)
    if not (
        _same_code(type(module).forward, llama.LlamaMLP.forward)
        and type(act) in (SiLUActivation, torch.nn.SiLU)
        and "forward" not in act.__dict__
    ):
        return None

    def forward(x: torch.Tensor) -> torch.Tensor:
        g, u = module.gate_proj(x), module.up_proj(x)
        if g.dtype not in FUSED_DTYPES or g.dtype != u.dtype or g.device.type != "cpu" or g.shape != u.shape:
            return module.down_proj(module.act_fn(g) * u)  # transformers' own expression
        n = g.shape[-1]
        return module.down_proj(ops.silu_mul(g.reshape(-1, n), u.reshape(-1, n)).view(g.shape))

    return forward


def _rotary(modeling: ModuleType, ops: ModuleType) -> Callable | None:
    original = modeling.__dict__.get("apply_rotary_pos_emb")
    if not (
        _same_code(original, llama.apply_rotary_pos_emb)
        and _same_code(modeling.__dict__.get("rotate_half"), llama.rotate_half)
    ):
        return None

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if not (
            unsqueeze_dim == 1
            and q.dtype in FUSED_DTYPES
            and q.dtype == k.dtype == cos.dtype == sin.dtype
            and q.device.type == "cpu"
            and q.dim() == k.dim() == 4
            and cos.shape == sin.shape == (q.shape[0], q.shape[2], q.shape[3]) == (k.shape[0], k.shape[2], k.shape[3])
            and q.stride(-1) == k.stride(-1) == 1
            and cos.is_contiguous()
            and sin.is_contiguous()
        ):
            return original(q, k, cos, sin, unsqueeze_dim)
        return ops.rotary(q, cos, sin), ops.rotary(k, cos, sin)

    return apply_rotary_pos_emb


class FusedModules:
    """The fused passes that apply to a model, put in place by `active()`.

    Each swap is (namespace, name, fused): a module's `__dict__` and "forward", or a modeling file's
    globals and "apply_rotary_pos_emb"; `active()` restores what was there.
    """

    def __init__(self, model: torch.nn.Module, ops: ModuleType) -> None:
        self.swaps: list[tuple[dict, str, Callable]] = []
        files: dict[str, ModuleType] = {}
        for module in model.modules():
            files.setdefault(type(module).__module__, sys.modules.get(type(module).__module__))
            if "forward" in module.__dict__:  # someone else's forward (accelerate hooks): left alone
                continue
            fn = _norm_forward(module, ops) or _mlp_forward(module, ops)
            if fn is not None:
                self.swaps.append((module.__dict__, "forward", fn))
        for modeling in files.values():
            fn = _rotary(modeling, ops) if modeling is not None else None
            if fn is not None:
                self.swaps.append((modeling.__dict__, "apply_rotary_pos_emb", fn))

    def __len__(self) -> int:
        return len(self.swaps)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The fused code in place while the block runs. Swaps are counted per place, process-wide: two
        engines (or threads) overlapping on one model in any order leave transformers' own code behind
        when the last of them leaves."""
        with _LOCK:
            for namespace, name, fn in self.swaps:
                key = (id(namespace), name)
                if key in _IN_PLACE:
                    _IN_PLACE[key][0] += 1
                else:
                    _IN_PLACE[key] = [1, namespace.get(name, _MISSING), namespace]
                    namespace[name] = fn
        try:
            yield
        finally:
            with _LOCK:
                for namespace, name, _ in self.swaps:
                    key = (id(namespace), name)
                    entry = _IN_PLACE[key]
                    entry[0] -= 1
                    if entry[0] == 0:
                        del _IN_PLACE[key]
                        if entry[1] is _MISSING:
                            namespace.pop(name, None)
                        else:
                            namespace[name] = entry[1]


_LOCK = threading.Lock()
_MISSING = object()
# (id of the namespace, name) -> [active count, what was there before the first swap, the namespace (kept alive)]
_IN_PLACE: dict[tuple[int, str], list] = {}
