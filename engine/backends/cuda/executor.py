"""The CUDA executor: the generic executor with flash-attn (engine/backends/cuda/__init__.py) and
decode/varlen graphs (engine/backends/cuda/graphs.py, varlen_graphs.py), captured in `warmup`.

Everything it needs beyond the generic executor is chosen by the backend and the graph flags
already. What it adds: every entry point runs with the model's GPU as the calling thread's current
device (`engine.device.on_device`). The engine is built on one thread (a server's loading thread),
warmed up on another and stepped on a third (the manager's loop, or the caller of generate_batch),
and torch's current device is per thread: on a model on cuda:1, graphs captured or events recorded
on the current device's streams would land on cuda:0.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.backends.executor import Executor
from engine.device import on_device
from engine.model_runner import StepInputs
from engine.sampler import PendingSample
from engine.scheduler import ScheduledBatch


class CUDAExecutor(Executor):
    launches_ahead = True  # kernels are queued on the stream; the host waits for a step's tokens alone
    def __init__(self, model: torch.nn.Module, config: Any, group: Any = None) -> None:
        with on_device(next(model.parameters()).device):
            super().__init__(model, config, group)

    def warmup(self) -> None:
        with on_device(self.device):
            super().warmup()

    def weights_replaced(self) -> None:
        with on_device(self.device):  # may capture the graphs again
            super().weights_replaced()

    def launch(self, batch: ScheduledBatch, default_logprobs: bool = False, feed: PendingSample | None = None
               ) -> PendingSample:  # fmt: skip
        with on_device(self.device):
            return super().launch(batch, default_logprobs, feed)

    def execute_inputs(self, step: StepInputs) -> None:
        with on_device(self.device):
            super().execute_inputs(step)
