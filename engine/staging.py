"""A step's integer tensors to the device in one non-blocking copy, through reused pinned buffers.

`HostStaging.send(parts)` packs the host tensors as int64 into a pinned buffer, starts one
non-blocking copy of it to the device and returns the parts there, in their shapes and dtypes. The
copy reads the buffer later, when the device gets to it, so a buffer is written again only once its
last copy has run: the buffers form a ring (two by default), each with a fence recorded on the
device's stream after its copy, and a step waits on the fence of the buffer it is about to fill.
Nothing assumes that a step ends in a host sync (a prompt-chunk step samples nothing and does not).
The fence of a buffer two steps back has almost always passed, so the wait costs nothing in steady
state; it only holds the host back when it runs two steps ahead of the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class Fence(Protocol):
    """Marks a point in the device's work: `record()` after a copy, `synchronize()` waits for it."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...


class CudaFence:
    """A CUDA event recorded on the device's current stream (named explicitly: the thread's current
    device may be another one)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.event = torch.cuda.Event()

    def record(self) -> None:
        self.event.record(torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        self.event.synchronize()


class HostStaging:
    def __init__(self, device: torch.device, slots: int = 2, *,
                 copy: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 new_fence: Callable[[], Fence] | None = None) -> None:  # fmt: skip
        """`copy`: host int64 buffer -> the same on the device, without blocking (default `.to(device,
        non_blocking=True)`); `new_fence`: a fence for one buffer (default a CUDA event on CUDA, none
        elsewhere: a copy from pageable memory has finished reading it when it returns)."""
        self.device = device
        self.pinned = device.type == "cuda"
        self._copy = copy or (lambda host: host.to(device, non_blocking=True))
        if new_fence is None and device.type == "cuda":
            new_fence = lambda: CudaFence(device)  # noqa: E731
        self._new_fence = new_fence
        self.buffers: list[torch.Tensor | None] = [None] * slots
        self.fences: list[Fence | None] = [None] * slots
        self._next = 0

    def send(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """The integer host tensors `parts` on the device (one copy), in their shapes and dtypes."""
        slot = self._next
        self._next = (slot + 1) % len(self.buffers)
        fence = self.fences[slot]
        if fence is not None:
            fence.synchronize()  # the last copy out of this buffer has run
        sizes = [p.numel() for p in parts]
        total = sum(sizes)
        buf = self.buffers[slot]
        if buf is None or buf.numel() < total:
            size = max(total, 2 * (0 if buf is None else buf.numel()))
            buf = self.buffers[slot] = torch.empty(size, dtype=torch.long, pin_memory=self.pinned)
        torch.cat([p.reshape(-1).long() for p in parts], out=buf[:total])
        flat = self._copy(buf[:total])
        if self._new_fence is not None:
            if fence is None:
                fence = self.fences[slot] = self._new_fence()
            fence.record()
        return [piece.view(p.shape).to(p.dtype) for piece, p in zip(flat.split(sizes), parts)]
