"""The CPU executor: the generic executor plus what the CPU adds to the model.

Before sizing the cache it tunes the allocator (engine/backends/cpu_malloc.py) and swaps in packed
linear weights (engine/backends/cpu_linear.py) and fused C++ element-wise passes
(engine/backends/cpu_fused.py), each active only inside the engine's forwards; for the models
whose code it knows, whole steps run the decoder stack in one native call
(engine/backends/cpu_layers.py).
"""

from __future__ import annotations

import logging
import os

import psutil

from engine.backends import cpu_malloc
from engine.backends import cpu_layers
from engine.backends.cpu_fused import FusedModules
from engine.backends.cpu_layers import NativeLayers
from engine.backends.cpu_linear import PackedLinears, compute_dtype, linear_plan, packed_bytes, packing_available
from engine.backends.executor import Executor
from engine.model_runner import ModuleSwaps, NativeForward

logger = logging.getLogger("cbserve.engine")
ASYNC_ON_CPU_ENV = "CBSERVE_ASYNC_BATCHING_ON_CPU"  # "1": async batching on the CPU too (its pipeline, tested here)


class CPUExecutor(Executor):
    packed_linears: PackedLinears | None = None
    fused_modules: FusedModules | None = None
    native_layers: NativeLayers | None = None

    def takes_async_batching(self, asked: bool) -> bool:
        """Not on the CPU, unless ASYNC_ON_CPU_ENV=1 (tests run the pipeline here): a step runs inside its
        launch, so nothing would overlap and each step's tokens would be handed out after the next step's
        forward, a step late."""
        if not asked or os.environ.get(ASYNC_ON_CPU_ENV) == "1":
            return asked
        logger.warning("cbserve: use_async_batching has no effect on the CPU: a step runs inside its launch there, so "
                       "nothing would overlap and each step's tokens would come a step late (%s=1 runs it anyway)",
                       ASYNC_ON_CPU_ENV)  # fmt: skip
        return False

    def module_swaps(self) -> list[ModuleSwaps]:
        if self.device.type != "cpu":  # another host-like device: the generic path only
            return []
        cpu_malloc.tune()  # freed activations stay mapped for the next step
        self.packed_linears = self._packed_linears()
        self.fused_modules = self._fused_modules()
        return [s for s in (self.packed_linears, self.fused_modules) if s]

    def native_forward(self) -> NativeForward | None:
        if self.device.type != "cpu":
            return None
        why = cpu_layers.why_not(self.model, self.packed_linears, self.fused_modules, self.backend.ops, self.dtype,
                                 tensor_parallel=self.peers is not None)  # fmt: skip
        if why is not None:
            logger.info("cbserve: decoder layers through transformers' modules (%s)", why)
            return None
        self.native_layers = NativeLayers(self.model, self.packed_linears, self.backend)
        logger.info("cbserve: %d decoder layers in one native call per step (%s=0 turns it off)",
                    self.native_layers.stack.num_layers, cpu_layers.ENV)  # fmt: skip
        return self.native_layers

    def weights_replaced(self) -> None:
        super().weights_replaced()
        if self.packed_linears:
            self.packed_linears.refresh()
        if self.native_layers:
            self.native_layers.rebuild()

    def _packed_linears(self) -> PackedLinears | None:
        choice, model = self.config.cpu_packed_weights, self.model
        if choice is False:
            return None
        ops = self.backend.ops  # the compiled kernels, when built
        if ops is None and not packing_available():
            return None
        plan = linear_plan(ops)
        size = packed_bytes(model, plan)
        if choice is None and size > psutil.virtual_memory().available / 4:
            logger.info("cbserve: linear weights not packed (%.1f GiB would not fit easily)", size / 2**30)
            return None
        packed = PackedLinears(model, plan)
        compute = compute_dtype(self.dtype)
        name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
        how = ""
        if plan.onednn and compute != self.dtype:
            how = f"; oneDNN's products in {name(compute)}: no {name(self.dtype)} ones on this CPU"
        logger.info("cbserve: %d linear layers on %s (%.0f MiB%s)", len(packed), plan.describe(self.dtype),
                    size / 2**20, how)
        return packed

    def _fused_modules(self) -> FusedModules | None:
        if self.backend.ops is None:
            return None
        fused = FusedModules(self.model, self.backend.ops)
        logger.info("cbserve: %d fused C++ element-wise passes (RMSNorm, rotary, MLP)", len(fused))
        return fused

