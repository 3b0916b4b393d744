"""Async batching: the host prepares step N+1 while the device runs step N.

Two slots of pinned host buffers alternate. Preparing a step writes its inputs (token ids, positions,
slots, lengths, block tables) into one slot; submitting it enqueues a non-blocking copy from that
slot to the device on the compute stream (so it lands after step N's forward has read the device
buffers) and records an event behind the copy. The host then prepares step N+1 in the other slot.
Before a slot is written again, its event must have completed: the device has copied out of it.

Ownership, per slot: FREE -> PREPARING (the host writes it) -> IN_FLIGHT (a copy out of it is
queued) -> PREPARING again once its event completed. At most one slot is PREPARING; the host never
writes a slot whose copy may still be reading it.

The token a decoding request feeds in step N+1 is the one it samples in step N, known only on the
device when N+1 is prepared: `carry_over_rows` says which rows of N+1 take which row of N's sampled
tokens, and `fill_carried_tokens` copies them on the device, without a host sync.

Events are injected (`torch.cuda.Event` on a GPU), so the bookkeeping is tested on the CPU.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


class Event(Protocol):
    def record(self) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class SlotState(enum.Enum):
    FREE = "free"
    PREPARING = "preparing"
    IN_FLIGHT = "in_flight"


@dataclass
class HostSlot:
    index: int
    buffers: dict[str, torch.Tensor]
    state: SlotState = SlotState.FREE
    step: int | None = None
    event: Event | None = field(default=None, repr=False)


def allocate_host_buffers(spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]], pin: bool) -> dict[str, torch.Tensor]:
    """Host tensors by name from {name: (shape, dtype)}; page-locked when `pin` (needs CUDA)."""
    return {name: torch.empty(shape, dtype=dtype, pin_memory=pin) for name, (shape, dtype) in spec.items()}


def cuda_event_factory(device: torch.device | str) -> Callable[[], Event]:
    """Events recorded on the current stream of a CUDA device."""

    def make() -> Event:
        return _StreamEvent(torch.device(device))

    return make


class _StreamEvent:
    def __init__(self, device: torch.device) -> None:
        self._event = torch.cuda.Event()
        self._device = device

    def record(self) -> None:
        self._event.record(torch.cuda.current_stream(self._device))

    def query(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()


class ImmediateEvent:
    """The event of a device whose copies are synchronous (the CPU): always complete."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def step_buffer_spec(max_tokens: int, max_seqs: int, max_blocks_per_seq: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The host-side inputs of one step, at their largest: what a slot holds."""
    return {
        "input_ids": ((max_tokens,), torch.long),
        "positions": ((max_tokens,), torch.long),
        "slot_mapping": ((max_tokens,), torch.long),
        "cu_seqlens_q": ((max_seqs + 1,), torch.int32),
        "seq_lens_k": ((max_seqs,), torch.int32),
        "block_tables": ((max_seqs, max_blocks_per_seq), torch.int32),
    }


def copy_prefixes(host: Mapping[str, torch.Tensor], device: Mapping[str, torch.Tensor], rows: Mapping[str, int]) -> None:
    """Copy the first `rows[name]` rows of each host buffer into its device buffer, without blocking."""
    for name, n in rows.items():
        device[name][:n].copy_(host[name][:n], non_blocking=True)


class DoubleBuffer:
    """Two host slots in rotation; see the module docstring for the ownership rules."""

    def __init__(self, make_buffers: Callable[[], dict[str, torch.Tensor]], make_event: Callable[[], Event]) -> None:
        self.slots = [HostSlot(0, make_buffers()), HostSlot(1, make_buffers())]
        self._make_event = make_event
        self._next = 0
        self.waits = 0  # times the host had to wait for the device to finish copying out of a slot

    @property
    def preparing(self) -> HostSlot | None:
        return next((s for s in self.slots if s.state is SlotState.PREPARING), None)

    def begin(self, step: int) -> HostSlot:
        """The slot to write step `step` into; waits for the device only if it still reads it."""
        if self.preparing is not None:
            raise RuntimeError(f"step {self.preparing.step} is still being prepared; submit it before step {step}")
        slot = self.slots[self._next]
        if slot.state is SlotState.IN_FLIGHT:
            assert slot.event is not None
            if not slot.event.query():
                self.waits += 1
                slot.event.synchronize()
        slot.state, slot.step, slot.event = SlotState.PREPARING, step, None
        return slot

    def submit(self, slot: HostSlot, copy_to_device: Callable[[dict[str, torch.Tensor]], None]) -> None:
        """Enqueue the copy out of a prepared slot, record its event, and rotate to the other slot."""
        if slot.state is not SlotState.PREPARING:
            raise RuntimeError(f"slot {slot.index} is {slot.state.value}, not being prepared: call begin() first")
        copy_to_device(slot.buffers)
        slot.event = self._make_event()
        slot.event.record()
        slot.state = SlotState.IN_FLIGHT
        self._next = 1 - slot.index

    def release_completed(self) -> list[int]:
        """Mark in-flight slots whose copy completed as free; returns their indices."""
        done = []
        for slot in self.slots:
            if slot.state is SlotState.IN_FLIGHT and slot.event is not None and slot.event.query():
                slot.state, slot.event = SlotState.FREE, None
                done.append(slot.index)
        return done


def carry_over_rows(previous: Sequence[str], current: Sequence[str], decoding: Sequence[bool]) -> tuple[list[int], list[int]]:
    """Rows of the current step whose input token is the previous step's sampled token.

    `previous` and `current` are the request ids of the two steps' rows; `decoding[i]` says whether
    current row i feeds the token it sampled last step (not a prompt chunk). Returns
    (current rows, previous rows), aligned.
    """
    if len(decoding) != len(current):
        raise ValueError(f"decoding has {len(decoding)} flags for {len(current)} rows")
    where = {rid: i for i, rid in enumerate(previous)}
    dst, src = [], []
    for i, (rid, dec) in enumerate(zip(current, decoding)):
        if dec:
            if rid not in where:
                raise ValueError(f"request {rid!r} decodes now but was not in the previous step")
            dst.append(i)
            src.append(where[rid])
    return dst, src


def fill_carried_tokens(
    input_ids: torch.Tensor, row_starts: torch.Tensor, dst_rows: torch.Tensor, sampled: torch.Tensor, src_rows: torch.Tensor
) -> None:
    """On the device: input_ids[row_starts[dst]] = sampled[src] (the decode rows' single tokens)."""
    input_ids.index_copy_(0, row_starts.index_select(0, dst_rows).long(), sampled.index_select(0, src_rows).to(input_ids.dtype))


def make_step_double_buffer(
    device: torch.device | str, max_tokens: int, max_seqs: int, max_blocks_per_seq: int
) -> DoubleBuffer:
    """Two slots of step inputs: pinned with CUDA events on a GPU, plain with immediate events on the CPU."""
    device = torch.device(device)
    spec = step_buffer_spec(max_tokens, max_seqs, max_blocks_per_seq)
    on_cuda = device.type == "cuda"
    make_event: Callable[[], Event] = cuda_event_factory(device) if on_cuda else ImmediateEvent
    return DoubleBuffer(lambda: allocate_host_buffers(spec, pin=on_cuda), make_event)
