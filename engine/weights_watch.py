"""`WeightsWatch`: one number that grows with every change made in place to a model's parameters (an
optimizer step, `load_state_dict`, `copy_`), read by the engine before each step: the sum of their
autograd version counters.

Read from Python, the sum is a chain of dependent loads per parameter through memory that the step's
weights have just pushed out of the caches (0.15-0.2 ms a step for SmolLM2's 272 parameters, against
0.013 ms warm). Where cbserve's CPU kernels are loaded, `VersionWatch` (engine/csrc/version_watch.h)
holds the counters themselves and sums them in one call. Inference tensors keep no counter: a model
with one has nothing to watch (`version()` is None).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch


class WeightsWatch:
    def __init__(self, params: Iterable[torch.Tensor], ops: ModuleType | None = None) -> None:
        self.params = list(params)
        self.tracked = not any(p.is_inference() for p in self.params)
        self.native = None  # the kernels' VersionWatch over the same counters, when they are loaded
        if self.tracked and ops is not None:
            self.native = ops.VersionWatch(self.params)

    def version(self) -> int | None:
        """The counters' sum now; None when the parameters keep no counters."""
        if not self.tracked:
            return None
        if self.native is not None:
            return self.native.sum()
        return sum(p._version for p in self.params)
