"""The CUDA executor: the generic executor with flash-attn (engine/backends/cuda/__init__.py) and
decode/varlen graphs (engine/backends/cuda/graphs.py, varlen_graphs.py), captured in `warmup`.

Everything it needs beyond the generic executor is chosen by the backend and the graph flags
already; it exists so that the CUDA side has one place to grow (memory profile of the graph
pools, streams) without touching the core.
"""

from __future__ import annotations

from engine.backends.executor import Executor


class CUDAExecutor(Executor):
    pass
