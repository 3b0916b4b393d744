"""Async batching's double-buffer bookkeeping on the CPU, with an injected event."""

from __future__ import annotations

import pytest
import torch

from engine.async_batching import (
    DoubleBuffer,
    SlotState,
    allocate_host_buffers,
    carry_over_rows,
    fill_carried_tokens,
)

SPEC = {"input_ids": ((8,), torch.long), "block_tables": ((4, 2), torch.int32)}


class FakeEvent:
    """A device event the test completes by hand; counts host waits."""

    log: list[str] = []

    def __init__(self) -> None:
        self.recorded = False
        self.done = False

    def record(self) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        FakeEvent.log.append("wait")
        self.done = True


def make_double_buffer():
    events: list[FakeEvent] = []

    def make_event():
        events.append(FakeEvent())
        return events[-1]

    return DoubleBuffer(lambda: allocate_host_buffers(SPEC, pin=False), make_event), events


def test_slots_alternate_and_each_submit_records_an_event():
    db, events = make_double_buffer()
    copies = []
    for step in range(6):
        slot = db.begin(step)
        assert slot.index == step % 2 and slot.state is SlotState.PREPARING and slot.step == step
        slot.buffers["input_ids"].fill_(step)
        db.submit(slot, lambda bufs: copies.append(int(bufs["input_ids"][0])))
        assert slot.state is SlotState.IN_FLIGHT and events[-1].recorded
        events[-1].done = True  # the device copied it
    assert copies == list(range(6))
    assert db.waits == 0


def test_host_waits_before_rewriting_a_slot_the_device_still_reads():
    db, events = make_double_buffer()
    FakeEvent.log.clear()
    a = db.begin(0)
    db.submit(a, lambda bufs: None)  # step 0's copy out of slot 0 is queued, not done
    b = db.begin(1)  # the other slot: no wait while step 0 runs
    assert b.index == 1 and db.waits == 0 and FakeEvent.log == []
    db.submit(b, lambda bufs: None)
    c = db.begin(2)  # slot 0 again: its copy has not completed, so the host waits once
    assert c.index == 0 and db.waits == 1 and FakeEvent.log == ["wait"]
    assert events[0].done


def test_never_two_slots_being_prepared_and_submit_needs_begin():
    db, _ = make_double_buffer()
    slot = db.begin(0)
    with pytest.raises(RuntimeError, match="step 0 is still being prepared"):
        db.begin(1)
    db.submit(slot, lambda bufs: None)
    with pytest.raises(RuntimeError, match="call begin"):
        db.submit(slot, lambda bufs: None)


def test_prepared_slot_is_never_the_one_in_flight():
    db, events = make_double_buffer()
    for step in range(20):
        slot = db.begin(step)
        others = [s for s in db.slots if s is not slot]
        # the slot the host writes is never one whose copy may still be pending
        assert slot.event is None and all(s.state is not SlotState.PREPARING for s in others)
        db.submit(slot, lambda bufs: None)
        if step % 3 == 0:
            events[-1].done = True


def test_release_completed_frees_slots_whose_copy_finished():
    db, events = make_double_buffer()
    db.submit(db.begin(0), lambda bufs: None)
    db.submit(db.begin(1), lambda bufs: None)
    assert db.release_completed() == []
    events[1].done = True
    assert db.release_completed() == [1]
    assert [s.state for s in db.slots] == [SlotState.IN_FLIGHT, SlotState.FREE]


def test_host_buffers_have_the_spec_shapes():
    bufs = allocate_host_buffers(SPEC, pin=False)
    assert bufs["input_ids"].shape == (8,) and bufs["block_tables"].dtype == torch.int32


def test_carry_over_rows_maps_decoding_requests_to_last_step_rows():
    dst, src = carry_over_rows(["a", "b", "c"], ["c", "a", "d"], [True, True, False])
    assert (dst, src) == ([0, 1], [2, 0])
    with pytest.raises(ValueError, match="'d' decodes now but was not in the previous step"):
        carry_over_rows(["a"], ["d"], [True])
    with pytest.raises(ValueError, match="2 flags for 1 rows"):
        carry_over_rows(["a"], ["a"], [True, False])


def test_fill_carried_tokens_writes_the_sampled_tokens_into_decode_rows():
    # step N+1 rows: "c" (decode), "a" (decode), "d" (a 3-token prompt chunk)
    input_ids = torch.tensor([-1, -1, 50, 51, 52])
    row_starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    sampled = torch.tensor([7, 8, 9])  # step N's tokens for rows a, b, c
    dst, src = carry_over_rows(["a", "b", "c"], ["c", "a", "d"], [True, True, False])
    fill_carried_tokens(input_ids, row_starts, torch.tensor(dst), sampled, torch.tensor(src))
    assert input_ids.tolist() == [9, 7, 50, 51, 52]


def test_step_double_buffer_on_the_cpu_copies_each_step_into_the_device_buffers():
    from engine.async_batching import copy_prefixes, make_step_double_buffer, step_buffer_spec

    db = make_step_double_buffer("cpu", max_tokens=16, max_seqs=4, max_blocks_per_seq=3)
    assert db.slots[0].buffers["block_tables"].shape == (4, 3) and not db.slots[0].buffers["input_ids"].is_pinned()
    device = allocate_host_buffers(step_buffer_spec(16, 4, 3), pin=False)  # stands in for the device buffers
    for step, n in enumerate([5, 9, 2]):
        slot = db.begin(step)
        slot.buffers["input_ids"][:n] = torch.arange(n) + 100 * step
        db.submit(slot, lambda bufs: copy_prefixes(bufs, device, {"input_ids": n}))
        assert device["input_ids"][:n].tolist() == (torch.arange(n) + 100 * step).tolist()
    assert db.waits == 0  # the CPU's copies are complete at once
