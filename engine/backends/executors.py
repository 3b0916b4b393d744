"""Which executor runs a model: the CPU's or CUDA's (engine/backends/executor.py), by where its weights are."""

from __future__ import annotations

import torch

from engine.backends.executor import Executor, RankPeers
from engine.config import ContinuousBatchingConfig


def make_executor(model: torch.nn.Module, config: ContinuousBatchingConfig, peers: RankPeers | None = None) -> Executor:
    """The executor for the device the model's weights are on; `peers`: the other tensor-parallel ranks
    when the model is one rank's shard."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        from engine.backends.cuda.executor import CUDAExecutor  # lazy: flash-attn and CUDA only here

        return CUDAExecutor(model, config, peers)
    from engine.backends.cpu_executor import CPUExecutor

    return CPUExecutor(model, config, peers)
