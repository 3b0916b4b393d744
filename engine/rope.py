"""Dynamic-NTK RoPE in engine steps without a host sync, and capturable in a CUDA graph.

transformers' `dynamic_rope_update` decorates a rotary embedding's forward: every call takes the
largest position id on the device and compares it with the length its frequencies were made for, as a
Python bool, which waits for the device each forward and cannot be captured. In an engine step
that length is already known on the host: the step's longest sequence (`meta.max_seqlen_k`).

`DynamicRope.of(model)` finds the model's rotary embeddings whose RoPE type is dynamic. Before each
step, `update(seq_len)` applies transformers' rule on that host integer (frequencies for `seq_len`
when it grows past the length they were made for; the original ones again when it falls back under
the model's length) to the module's own attributes, writing the frequencies in place into one buffer
that stays the module's (captured graphs read its address). Inside engine steps the module runs its
undecorated forward; anywhere else (a `model.generate` on another thread) its own. The engine never
runs past `max_position_embeddings`, so in practice the frequencies it uses are the original ones,
put back when a `model.generate` beyond the model's length left scaled ones behind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

from engine import attention

# the code object of every forward that dynamic_rope_update wraps
_UPDATE_WRAPPER = dynamic_rope_update(lambda self, x, position_ids: None).__code__


def undecorated(forward: Callable) -> Callable | None:
    """The function under `dynamic_rope_update` in a chain of decorators, or None if it is not there."""
    fn: Any = forward
    while fn is not None:
        if getattr(fn, "__code__", None) is _UPDATE_WRAPPER:
            return fn.__wrapped__
        fn = getattr(fn, "__wrapped__", None)
    return None


@dataclass
class _Frequencies:
    """One dynamic RoPE: a module, and its layer type when its frequencies are kept per layer type."""

    module: torch.nn.Module
    layer_type: str | None
    buffer: torch.Tensor  # the frequencies' tensor, the module's buffer from now on

    @property
    def prefix(self) -> str:
        return "" if self.layer_type is None else f"{self.layer_type}_"

    def keep_buffer(self) -> None:
        """The module's buffer is `self.buffer` again, holding whatever frequencies the module was
        given meanwhile (transformers' own update registers new tensors, or the original ones)."""
        name = self.prefix + "inv_freq"
        current = self.module._buffers[name]
        if current is not self.buffer:
            self.buffer.copy_(current)
            self.module._buffers[name] = self.buffer

    def update(self, seq_len: int) -> None:
        """transformers' dynamic rule, on a host integer (no device read)."""
        module, prefix = self.module, self.prefix
        self.keep_buffer()
        cached = getattr(module, prefix + "max_seq_len_cached", module.max_seq_len_cached)  # as transformers reads it
        original = module.original_max_seq_len
        if seq_len > cached:  # growth: the frequencies for this length, made on the host
            rope_type = module.rope_type if self.layer_type is None else module.rope_type[self.layer_type]
            kwargs = {} if self.layer_type is None else {"layer_type": self.layer_type}
            # the length as a (host) tensor, as transformers passes it: the same float32 arithmetic
            inv_freq, module.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](
                module.config, "cpu", seq_len=torch.tensor(seq_len), **kwargs
            )
            self.buffer.copy_(inv_freq.pin_memory() if self.buffer.is_cuda else inv_freq, non_blocking=True)
            setattr(module, prefix + "max_seq_len_cached", seq_len)
        if seq_len < original and cached > original:  # back under the model's length: the original ones
            self.buffer.copy_(getattr(module, prefix + "original_inv_freq"), non_blocking=True)
            setattr(module, prefix + "max_seq_len_cached", original)


class DynamicRope:
    def __init__(self, frequencies: list[_Frequencies]) -> None:
        self.frequencies = frequencies

    @classmethod
    def of(cls, model: torch.nn.Module) -> DynamicRope | None:
        """The model's dynamic RoPEs, their forwards made step-aware; None when it has none."""
        found = []
        for module in model.modules():
            rope_type = getattr(module, "rope_type", None)
            if not hasattr(module, "original_max_seq_len") or rope_type is None:
                continue
            types = [(None, rope_type)] if isinstance(rope_type, str) else list(rope_type.items())
            dynamic = [layer_type for layer_type, name in types if "dynamic" in name]
            if not dynamic:
                continue
            plain = undecorated(type(module).forward)
            if plain is None:
                raise ValueError(f"{type(module).__name__} has a dynamic RoPE but its forward is not transformers' "
                                 "dynamic_rope_update: cbserve cannot run it without a host sync")  # fmt: skip
            _step_aware(module, plain)
            for layer_type in dynamic:
                name = ("" if layer_type is None else f"{layer_type}_") + "inv_freq"
                buffer = module._buffers[name].clone()  # never the original frequencies' tensor
                module._buffers[name] = buffer
                found.append(_Frequencies(module, layer_type, buffer))
        return cls(found) if found else None

    def update(self, seq_len: int) -> None:
        """Frequencies for a step whose longest sequence holds `seq_len` tokens."""
        for freq in self.frequencies:
            freq.update(seq_len)


def _step_aware(module: torch.nn.Module, plain: Callable) -> None:
    """`module.forward`: `plain` (no update) inside engine steps, its own forward anywhere else."""
    own = module.forward
    if getattr(own, "cbserve_step_aware", False):
        return

    def forward(*args: Any, **kwargs: Any) -> Any:
        if attention.in_engine_step():
            return plain(module, *args, **kwargs)
        return own(*args, **kwargs)

    forward.cbserve_step_aware = True  # type: ignore[attr-defined]
    module.forward = forward
