"""The engine YAML the pod reads with `--config`: ContinuousBatchingConfig knobs by their Python names."""

from __future__ import annotations

import hashlib
from typing import Any

import yaml

from .spec import Engine


def engine_settings(engine: Engine) -> dict[str, Any]:
    """The knobs as the server's config file spells them; unset sizes are left out (derived at start-up)."""
    settings: dict[str, Any] = {
        "block_size": engine.block_size,
        "num_blocks": engine.num_blocks,
        "max_batch_tokens": engine.max_batch_tokens,
        "max_memory_percent": engine.max_memory_percent,
        "use_cuda_graph": _cuda_graphs(engine),
        "scheduler_type": engine.scheduler_type,
        "allow_block_sharing": engine.prefix_caching,
        "cpu_offload_space": engine.cpu_offload_gib,
        "max_queue_size": engine.max_queue_size,
        "dtype": engine.dtype,
        "attn_implementation": engine.attn_implementation,
        "compile": engine.backends.compile,
    }
    return {k: v for k, v in settings.items() if v is not None}


def _cuda_graphs(engine: Engine) -> bool | list[bool] | None:
    if engine.cuda_graphs_varlen is None and engine.cuda_graphs_decode is None:
        return engine.backends.cuda.graphs
    base = bool(engine.backends.cuda.graphs)
    varlen = base if engine.cuda_graphs_varlen is None else engine.cuda_graphs_varlen
    decode = base if engine.cuda_graphs_decode is None else engine.cuda_graphs_decode
    return [varlen, decode]


def render_engine_yaml(engine: Engine) -> str:
    header = "# Written by the cbserve operator from the CBDeployment's spec.engine; edit the CBDeployment.\n"
    return header + yaml.safe_dump(engine_settings(engine), sort_keys=True)


def config_hash(text: str) -> str:
    """Short content hash; it annotates the pod template so a changed knob rolls the pods."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]
