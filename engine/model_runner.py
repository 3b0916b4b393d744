"""Runs one step: packs every scheduled token into a ragged [1, T] batch and calls the model once.

The step's metadata (positions, slots, lengths, block tables) is built with numpy array ops; the only
Python loops are per sequence, never per token. The LM head runs on the last position of each
sequence that samples this step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from engine import attention
from engine.attention import StepContext
from engine.backends.base import AttentionBackend, AttentionMetadata
from engine.kv_cache import PagedKVCache
from engine.rope import DynamicRope
from engine.scheduler import ScheduledBatch
from engine.staging import HostStaging


def restore_modes(model: torch.nn.Module, modes: list[bool]) -> None:
    """Put each module back in the train/eval mode it had (modes from `model.modules()`, in order)."""
    for module, training in zip(model.modules(), modes):
        module.training = training


@dataclass
class StepInputs:
    """One step as plain lists: what build_metadata needs, and what rank 0 of a tensor-parallel
    engine sends the other ranks each step (as tensors: engine/tp_messages.py)."""

    token_ids: list[int]  # the step's tokens, sequence after sequence
    q_lens: list[int]  # tokens of each sequence in this step
    starts: list[int]  # tokens of each sequence already in the cache
    block_tables: list[list[int]]  # each sequence's KV blocks
    sample_rows: list[int]  # sequences whose last token's logits are wanted (none on ranks > 0)
    copies: list[tuple[int, int]]  # copy-on-write block copies (source, destination) before the forward

    @classmethod
    def of(cls, batch: ScheduledBatch, sample_rows: list[int]) -> StepInputs:
        if batch.ahead:  # one token a row, not yet known on the host (the executor feeds it on the device)
            n = len(batch.items)
            tables = [r.block_ids for r, _ in batch.items]
            return cls([0] * n, [1] * n, list(batch.ahead_starts), tables, sample_rows, list(batch.copies or ()))
        token_ids: list[int] = []
        q_lens, starts, tables = [], [], []
        for r, n in batch.items:
            s = r.num_computed
            token_ids.extend(r.token_ids[s : s + n])
            q_lens.append(n)
            starts.append(s)
            tables.append(r.block_ids)
        return cls(token_ids, q_lens, starts, tables, sample_rows, list(batch.copies or ()))


class StepForward(Protocol):
    """A step's forward: (input_ids, positions, meta, logits_rows) -> logits."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 logits_rows: torch.Tensor) -> torch.Tensor: ...  # fmt: skip


class ModuleSwaps(Protocol):
    """Replacement forwards for some of the model's modules, in place while `active()` is entered."""

    def __len__(self) -> int: ...

    def active(self) -> contextlib.AbstractContextManager[None]: ...


class NativeForward(Protocol):
    """A whole step's forward outside transformers' modules (the CPU's native decoder stack:
    engine/backends/cpu_layers.py): logits, or None for a step it does not take."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 logits_rows: torch.Tensor, cache: PagedKVCache) -> torch.Tensor | None: ...  # fmt: skip


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, cache: PagedKVCache, backend: AttentionBackend,
        module_swaps: Sequence[ModuleSwaps] = (),
    ) -> None:  # fmt: skip
        self.model = model
        self.cache = cache
        self.backend = backend
        # CPU: packed linears, fused norms and MLPs; their forwards replace the modules' own only
        # inside the engine's forwards
        self.module_swaps = [s for s in module_swaps if s]
        self.native: NativeForward | None = None  # tried first for each step when set (the executor's)
        self.device = next(model.parameters()).device
        self.block_size = cache.block_size
        self.last_prepare_s = 0.0  # time build_metadata took in the last run()
        # False on tensor-parallel ranks other than 0: the LM head runs on no row (only rank 0 samples)
        self.computes_logits = True
        self.no_mask = attention.no_mask(self.device)  # spares transformers' mask building (engine/attention.py)
        self.rope = DynamicRope.of(model)  # dynamic-NTK RoPE, updated from the host before each step
        # pinned host buffers of a step's integers (accelerators), never refilled under a pending copy
        self.staging = HostStaging(self.device) if self.device.type != "cpu" else None

    def build_metadata(
        self, step: StepInputs
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The step's tensors on the device: input ids, positions, the attention metadata and the rows
        of the logits to keep. Built on the host; on an accelerator they travel in one non-blocking
        copy from a pinned buffer (engine/staging.py), never as a blocking copy per tensor."""
        q_lens, starts, token_ids = step.q_lens, step.starts, step.token_ids
        k_lens = [s + n for s, n in zip(starts, q_lens)]
        # numpy, then one zero-copy torch.from_numpy each: a step's small integer arrays cost a
        # microsecond an op in numpy against several in torch's dispatcher, whose structures the
        # forward has evicted from the caches by the time the next step is built
        num_seqs = len(q_lens)
        q = np.array(q_lens, dtype=np.int64)
        cu = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(q, out=cu[1:])
        total = len(token_ids)
        bs = self.block_size
        max_blocks = max(map(len, step.block_tables))
        tables = np.array([t + [0] * (max_blocks - len(t)) for t in step.block_tables], dtype=np.int32)
        seq_idx = np.repeat(np.arange(num_seqs), q)
        positions = np.array(starts, dtype=np.int64)[seq_idx] + (np.arange(total) - cu[:-1][seq_idx])
        blocks = tables[seq_idx, positions // bs]
        slot_mapping = blocks.astype(np.int64) * bs + positions % bs
        logits_rows = (cu[1:].astype(np.int64) - 1)[np.array(step.sample_rows, dtype=np.int64)]
        input_ids = torch.from_numpy(np.array(token_ids, dtype=np.int64))
        positions = torch.from_numpy(positions)
        slot_mapping = torch.from_numpy(slot_mapping)
        cu_seqlens_q = torch.from_numpy(cu)
        seq_lens_k = torch.from_numpy(np.array(k_lens, dtype=np.int32))
        block_tables = torch.from_numpy(tables)
        logits_rows = torch.from_numpy(logits_rows)
        if self.staging is not None:
            moved = self.staging.send(
                [input_ids, positions, slot_mapping, cu_seqlens_q, seq_lens_k, block_tables, logits_rows]
            )
            input_ids, positions, slot_mapping, cu_seqlens_q, seq_lens_k, block_tables, logits_rows = moved

        num_decodes = 0
        while num_decodes < num_seqs and q_lens[num_decodes] == 1:
            num_decodes += 1
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            cu_seqlens_q=cu_seqlens_q,
            seq_lens_k=seq_lens_k,
            block_tables=block_tables,
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(k_lens),
            block_size=bs,
            q_lens=q_lens,
            k_lens=k_lens,
        )
        return input_ids, positions, meta, logits_rows

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, logits_rows: torch.Tensor
    ) -> torch.Tensor:
        """The eager model call of one step: logits [len(logits_rows), vocab] in the model's dtype (no
        rows when the runner computes no logits)."""
        if not self.computes_logits:
            logits_rows = logits_rows[:0]  # also inside captured graphs: the head multiplies nothing
        if self.native is not None:
            with attention.engine_step():  # the model's rotary embedding runs its step-aware forward
                logits = self.native(input_ids, positions, meta, logits_rows, self.cache)
            if logits is not None:
                return logits
        self.backend.prepare(meta)
        with attention.installed(self.model), attention.engine_step(), contextlib.ExitStack() as swaps:
            for swap in self.module_swaps:
                swaps.enter_context(swap.active())
            out = self.model(
                input_ids=input_ids[None],
                position_ids=positions[None],
                attention_mask=self.no_mask,
                use_cache=False,
                logits_to_keep=logits_rows,
                cb_step=StepContext(self.backend, self.cache, meta),
            )
        return out.logits[0]

    @torch.inference_mode()
    def run(self, step: StepInputs, dispatch: StepForward | None = None,
            before_forward: Callable[[AttentionMetadata], None] | None = None,
            input_ids: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Forward the step; returns logits [len(step.sample_rows), vocab] for those sequences (model
        dtype). `dispatch` runs the forward (a graph replay or a compiled forward:
        engine/backends/step_dispatch.py); None: `self.forward`, eagerly. `before_forward` is called
        with the step's metadata before the forward (tensor-parallel ranks agree on its route there).
        `input_ids`: the step's tokens already on the device (a step scheduled ahead of the last one's
        tokens), in place of `step.token_ids`."""
        start = time.perf_counter()
        ids, positions, meta, logits_rows = self.build_metadata(step)
        if input_ids is None:
            input_ids = ids
        if self.rope is not None:
            self.rope.update(meta.max_seqlen_k)
        self.last_prepare_s = time.perf_counter() - start
        if before_forward is not None:
            before_forward(meta)
        return (dispatch or self.forward)(input_ids, positions, meta, logits_rows)
