"""The attention function cbserve registers with transformers' AttentionInterface, once.

Every model that goes through the attention interface calls it once per layer with the layer's
query, key and value ([1, heads, T, head_dim] for the step's packed tokens). Inside an engine step
(the model forward gets the `cb_step` kwarg) it hands them to the step's backend, which writes K/V
into the paged cache and attends over each sequence's own blocks. Anywhere else (a `model.generate`
on the same model, on any thread, while the engine runs) it is the model's own implementation.

`installed(model)`, around each engine step, sets the model's implementation to
`cbserve_paged+<its own>` ("+sdpa", "+eager", ...), registered with the attention and mask
interfaces on first use (the mask is the model's own outside engine steps and none inside them: the
engine's attention needs no mask), and puts the model's own name back when the last step running on
that model ends. Between steps the model is as it was: transformers' own continuous batching, which
accepts only implementations it knows, and `save_pretrained` see its own implementation.

An engine step's forward also gets `attention_mask=no_mask(device)`, an empty 4-D tensor: transformers'
mask functions return a 4-D mask as it is, before anything else. Without it they would look for
packed sequences in the position ids and read the answer back to the host (a sync every forward).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from engine.backends.base import AttentionBackend, AttentionMetadata
from engine.kv_cache import PagedKVCache

ATTN_IMPLEMENTATION = "cbserve_paged"  # engine steps only: raises without `cb_step`
_IN_STEP = contextvars.ContextVar("cbserve_in_engine_step", default=False)  # per thread
_registered: set[str] = set()
_lock = threading.Lock()
# id(model config) -> (steps running on it, its own implementation, cbserve's name set over it)
_steps: dict[int, tuple[int, str | None, str]] = {}


def no_mask(device: torch.device) -> torch.Tensor:
    """The `attention_mask` of an engine step: 4-D, so transformers takes it as a prepared mask and
    builds none; empty, as the paged attention reads no mask."""
    return torch.empty(1, 1, 0, 0, dtype=torch.bool, device=device)


@dataclass
class StepContext:
    """What the attention function needs for one forward; passed as the `cb_step` model kwarg."""

    backend: AttentionBackend
    cache: PagedKVCache
    meta: AttentionMetadata


def _paged(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           cb_step: StepContext, scaling: float | None = None, sliding_window: int | None = None,
           softcap: float | None = None) -> tuple[torch.Tensor, None]:  # fmt: skip
    layer = module.layer_idx
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = cb_step.backend.attend(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        cb_step.cache.k[layer],
        cb_step.cache.v[layer],
        cb_step.meta,
        scaling=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
    )
    return out.unsqueeze(0), None  # [1, T, H, D]


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            cb_step: StepContext | None = None, sliding_window=None, softcap=None, **kwargs):  # fmt: skip
    if cb_step is None:
        raise RuntimeError(
            f"attn_implementation {ATTN_IMPLEMENTATION!r} runs only inside cbserve's engine "
            "(the model forward must receive the `cb_step` kwarg)"
        )
    return _paged(module, query, key, value, cb_step, scaling, sliding_window, softcap)


def _own_attention(module: torch.nn.Module, name: str) -> Callable:
    if name == "eager":  # each modeling file has its own eager function
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def _register(name: str, own: str) -> None:
    def attention(module, query, key, value, attention_mask, cb_step: StepContext | None = None, **kwargs):
        if cb_step is None:
            return _own_attention(module, own)(module, query, key, value, attention_mask, **kwargs)
        return _paged(module, query, key, value, cb_step, kwargs.get("scaling"), kwargs.get("sliding_window"),
                      kwargs.get("softcap"))  # fmt: skip

    AttentionInterface.register(name, attention)
    own_mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(own)
    if own_mask is not None:  # else no mask anywhere, as for the model's own implementation

        def mask(*args, **kwargs):
            return None if _IN_STEP.get() else own_mask(*args, **kwargs)

        AttentionMaskInterface.register(name, mask)
    _registered.add(name)


def implementation_for(own: str | None) -> str:
    """The registered name of cbserve's attention over the model's own implementation `own`."""
    own = own or "eager"
    if own.startswith(ATTN_IMPLEMENTATION + "+"):
        return own
    name = f"{ATTN_IMPLEMENTATION}+{own}"
    if name not in _registered:
        _register(name, own)
    return name


@contextlib.contextmanager
def installed(model: torch.nn.Module) -> Iterator[None]:
    """The model's attention goes through cbserve's function for the duration (steps of several
    engines on one model overlap safely: the first sets it, the last puts the model's own back, unless
    someone set another implementation meanwhile). Other threads' forwards meanwhile get the model's
    own attention from the wrapper."""
    config = model.config
    key = id(config)
    with _lock:
        if key in _steps:
            count, own, wrapped = _steps[key]
        else:
            count, own = 0, config._attn_implementation
            if own and own.startswith(ATTN_IMPLEMENTATION + "+"):  # set by hand, or by an older cbserve
                own = own.removeprefix(ATTN_IMPLEMENTATION + "+")
            wrapped = implementation_for(own)
            config._attn_implementation = wrapped
        _steps[key] = (count + 1, own, wrapped)
    try:
        yield
    finally:
        with _lock:
            count, own, wrapped = _steps.pop(key)
            if count > 1:
                _steps[key] = (count - 1, own, wrapped)
            elif config._attn_implementation == wrapped:
                config._attn_implementation = own


def in_engine_step() -> bool:
    """Whether this thread is inside an engine step's forward."""
    return _IN_STEP.get()


@contextlib.contextmanager
def engine_step() -> Iterator[None]:
    """Marks this thread's forward as an engine step: masks are skipped (the paged attention needs none)."""
    token = _IN_STEP.set(True)
    try:
        yield
    finally:
        _IN_STEP.reset(token)


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
