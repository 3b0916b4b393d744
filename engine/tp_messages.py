"""What rank 0 of a tensor-parallel engine sends the other ranks, as tensors (no pickling).

Every message is a fixed int64 header of `HEADER` numbers, its kind first. A step's header holds its
sizes and its route (which graph runs it: engine/backends/step_dispatch.py), and is followed by one
flat int32 body:

    token ids | each sequence's query length | its start | its block-table length |
    the block tables, one after another | copy-on-write copies (source, destination)

A decode step of B sequences with tables of W blocks is B * (4 + W) integers. The rows that sample
are not sent: only rank 0 computes logits. The cache sizes (a `CachePlan`, all integers) go once,
as the header's numbers.
"""

from __future__ import annotations

import dataclasses
import enum
from array import array
from itertools import chain

import numpy as np
import torch

from engine.backends.memory import CachePlan
from engine.backends.step_dispatch import Route
from engine.model_runner import StepInputs

SIZE_FIELDS = [f.name for f in dataclasses.fields(CachePlan)]
HEADER = max(8, 1 + len(SIZE_FIELDS))  # int64 numbers: the kind, then the kind's own


class Kind(enum.IntEnum):
    STOP = 0
    STEP = 1
    WARMUP = 2  # capture the graphs now, as rank 0 does
    SIZES = 3


def header(kind: Kind, *numbers: int) -> torch.Tensor:
    """A message's header: its kind, its numbers, zeros after them."""
    values = array("q", [int(kind), *numbers])
    values.extend([0] * (HEADER - len(values)))
    return torch.frombuffer(values, dtype=torch.int64)


def encode_step(step: StepInputs, route: Route) -> tuple[torch.Tensor, torch.Tensor]:
    """The header (sizes, then rank 0's route: which graph runs the step) and the int32 body of a step
    (its sample rows left out)."""
    lens = [len(t) for t in step.block_tables]
    head = header(Kind.STEP, len(step.token_ids), len(step.q_lens), sum(lens), len(step.copies), *route)
    parts = chain(step.token_ids, step.q_lens, step.starts, lens, chain.from_iterable(step.block_tables),
                  chain.from_iterable(step.copies))  # fmt: skip
    return head, torch.from_numpy(np.fromiter(parts, dtype=np.int32, count=body_size(head)))


def body_size(head: torch.Tensor) -> int:
    """Integers in the body that follows a step's header."""
    tokens, seqs, entries, copies = head[1:5].tolist()
    return tokens + 3 * seqs + entries + 2 * copies


def decode_step(head: torch.Tensor, body: torch.Tensor) -> tuple[StepInputs, Route]:
    """The step a header and body carry (with no rows to sample), and its route."""
    _, tokens, seqs, _, copies, how, a, b = head[:8].tolist()
    values = body.numpy().tolist()
    at = 0

    def take(n: int) -> list[int]:
        nonlocal at
        at += n
        return values[at - n : at]

    token_ids, q_lens, starts, lens = take(tokens), take(seqs), take(seqs), take(seqs)
    tables = [take(n) for n in lens]
    flat = take(2 * copies)
    pairs = list(zip(flat[0::2], flat[1::2]))
    return StepInputs(token_ids, q_lens, starts, tables, [], pairs), (how, a, b)


def encode_sizes(sizes: CachePlan) -> torch.Tensor:
    return header(Kind.SIZES, *(getattr(sizes, name) for name in SIZE_FIELDS))


def decode_sizes(head: torch.Tensor) -> CachePlan:
    if Kind(int(head[0])) != Kind.SIZES:
        raise RuntimeError(f"expected rank 0's cache sizes, got a {Kind(int(head[0])).name} message")
    return CachePlan(**{name: int(v) for name, v in zip(SIZE_FIELDS, head[1:].tolist())})
