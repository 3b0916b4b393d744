"""Optional `torch.compile` of the step's forward, from transformers' compile configs.

transformers' continuous batching takes a `varlen_compile_config` (prefill and mixed steps) and a
`decode_compile_config` (pure decode steps), each a `transformers.CompileConfig` (`fullgraph`,
`dynamic`, `backend`, `mode`, `options`). cbserve accepts the same objects, or dicts of those
fields (from YAML), and compiles the matching forward with them; `None` leaves it eager.

A compile mode that captures CUDA graphs itself (`reduce-overhead`, `max-autotune`, or the option
`triton.cudagraphs`) cannot be combined with cbserve's own decode graphs: `compile_step` refuses it
with an error that says what to use instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

COMPILE_FIELDS = ("fullgraph", "dynamic", "backend", "mode", "options")
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def compile_kwargs(config: Any) -> dict[str, Any] | None:
    """torch.compile keyword arguments from a CompileConfig, a dict of its fields, or None."""
    if config is None:
        return None
    if isinstance(config, Mapping):
        values = dict(config)
    elif all(hasattr(config, name) for name in COMPILE_FIELDS):
        values = {name: getattr(config, name) for name in COMPILE_FIELDS}
    else:
        raise ValueError(
            f"a compile config must be a transformers CompileConfig or a mapping of {COMPILE_FIELDS}, got {config!r}"
        )
    unknown = set(values) - set(COMPILE_FIELDS)
    if unknown:
        raise ValueError(f"unknown compile config field(s) {sorted(unknown)}; known: {', '.join(COMPILE_FIELDS)}")
    kwargs: dict[str, Any] = {
        "fullgraph": bool(values.get("fullgraph", False)),
        "dynamic": values.get("dynamic"),
        "backend": values.get("backend", "inductor"),
    }
    mode, options = values.get("mode"), values.get("options")
    if mode is not None and options:
        raise ValueError("a compile config takes `mode` or `options`, not both (torch.compile's rule)")
    if options:
        kwargs["options"] = dict(options)
    elif mode is not None:
        kwargs["mode"] = mode
    return kwargs


def uses_cuda_graphs(kwargs: Mapping[str, Any]) -> bool:
    """Whether these torch.compile arguments make inductor capture CUDA graphs of its own."""
    if kwargs.get("mode") in CUDAGRAPH_MODES:
        return True
    return bool((kwargs.get("options") or {}).get("triton.cudagraphs", False))


def compile_step(forward: F, config: Any, *, cbserve_graphs: bool = False, name: str = "compile config") -> F:
    """`forward` compiled as `config` says (unchanged for None)."""
    kwargs = compile_kwargs(config)
    if kwargs is None:
        return forward
    if cbserve_graphs and uses_cuda_graphs(kwargs):
        raise ValueError(
            f"{name} uses inductor's own CUDA graphs (mode {kwargs.get('mode')!r}), which clash with cbserve's "
            "decode graphs: use mode 'default' or 'max-autotune-no-cudagraphs', or set use_cuda_graph to false"
        )
    return torch.compile(forward, **kwargs)  # type: ignore[return-value]
