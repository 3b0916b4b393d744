"""CUDA graphs for decode steps: buckets, graph keys, padding, capture and replay.

A decode step (every sequence has one query token) is the same handful of kernels every time, only
the batch size changes. At `warmup()` the runner captures one graph per padded batch size
(1, 2, 4, 8, ... up to the request cap, the cap itself last) into one shared memory pool, all
reading persistent input buffers. A step then copies its inputs into the buffers, pads them to the
smallest bucket that holds it, replays that graph and reads the first rows of its output.

Padding rows are harmless by construction: each is a one-token sequence of length 1 whose only
block is the engine's reserved padding block (never handed to a request), so its key/value write
and its attention touch nothing a real request owns. The cache must therefore be allocated with
`PAD_BLOCKS` (engine/backends/step_dispatch.py) extra block(s) beyond the ones the block manager hands out (`pad_block = num_blocks`).

Prefill and mixed steps run eagerly unless varlen graphs are asked for (engine/backends/cuda/varlen_graphs.py).
The pure logic here runs anywhere; capture itself needs CUDA, except through an injected capturer
(tests replay eagerly on the CPU).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.backends.base import AttentionMetadata

logger = logging.getLogger("cbserve.cuda_graphs")

# (input_ids [T], positions [T], meta, logits_rows [R]) -> float logits [R, vocab]; calls backend.prepare(meta).
StepForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]


def graph_batch_sizes(max_requests: int) -> list[int]:
    """Padded batch sizes to capture: powers of two below the request cap, then the cap."""
    if isinstance(max_requests, bool) or not isinstance(max_requests, int) or max_requests <= 0:
        raise ValueError(f"max_requests must be a positive integer, got {max_requests!r}")
    sizes, size = [], 1
    while size < max_requests:
        sizes.append(size)
        size *= 2
    sizes.append(max_requests)
    return sizes


def bucket_for(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds n rows, or None when n is larger than every one."""
    if n <= 0:
        raise ValueError(f"a step has at least one sequence, got {n}")
    for size in sizes:
        if size >= n:
            return size
    return None


def choose_decode_graph(meta: AttentionMetadata, sizes: Sequence[int], max_blocks_per_seq: int) -> int | None:
    """The graph (its padded batch size) that runs this step, or None to run it eagerly.

    Only pure decode steps replay a graph; their batch must fit the largest bucket and their
    block tables the buffers' width.
    """
    if meta.num_seqs == 0 or meta.num_decodes != meta.num_seqs:
        return None
    if meta.block_tables.shape[1] > max_blocks_per_seq:
        return None
    return bucket_for(meta.num_seqs, sizes)


@dataclass
class DecodeBuffers:
    """Persistent inputs of every decode graph (views of their first rows are what each graph reads)."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [B] int64
    seq_lens_k: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, W] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32, always 0..B (one query per row)
    logits_rows: torch.Tensor  # [B] int64, always 0..B-1

    @classmethod
    def allocate(cls, max_batch: int, max_blocks_per_seq: int, device: torch.device | str) -> DecodeBuffers:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            input_ids=zeros(max_batch, dtype=torch.long),
            positions=zeros(max_batch, dtype=torch.long),
            slot_mapping=zeros(max_batch, dtype=torch.long),
            seq_lens_k=zeros(max_batch, dtype=torch.int32),
            block_tables=zeros(max_batch, max_blocks_per_seq, dtype=torch.int32),
            cu_seqlens_q=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
            logits_rows=torch.arange(max_batch, dtype=torch.long, device=device),
        )

    @property
    def max_batch(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_tables.shape[1]


def fill_decode_buffers(
    buf: DecodeBuffers,
    bucket: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    pad_block: int,
) -> None:
    """Copy a decode step's n rows into the buffers and pad rows n..bucket-1 onto the padding block."""
    n, width = meta.num_seqs, meta.block_tables.shape[1]
    if n > bucket or bucket > buf.max_batch or width > buf.max_blocks_per_seq:
        raise ValueError(
            f"a decode step of {n} sequences x {width} blocks does not fit bucket {bucket} of buffers "
            f"{buf.max_batch} x {buf.max_blocks_per_seq}"
        )
    pad_slot = pad_block * meta.block_size
    buf.input_ids[:n].copy_(input_ids, non_blocking=True)
    buf.positions[:n].copy_(positions, non_blocking=True)
    buf.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
    buf.seq_lens_k[:n].copy_(meta.seq_lens_k, non_blocking=True)
    buf.block_tables[:bucket].zero_()
    buf.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
    if bucket > n:
        buf.input_ids[n:bucket].zero_()
        buf.positions[n:bucket].zero_()
        buf.slot_mapping[n:bucket].fill_(pad_slot)
        buf.seq_lens_k[n:bucket].fill_(1)
        buf.block_tables[n:bucket, 0].fill_(pad_block)


def graph_metadata(buf: DecodeBuffers, bucket: int, block_size: int) -> AttentionMetadata:
    """The metadata a bucket's graph is captured with: views of the buffers, host fields fixed."""
    width = buf.max_blocks_per_seq
    return AttentionMetadata(
        slot_mapping=buf.slot_mapping[:bucket],
        cu_seqlens_q=buf.cu_seqlens_q[: bucket + 1],
        seq_lens_k=buf.seq_lens_k[:bucket],
        block_tables=buf.block_tables[:bucket],
        num_decodes=bucket,
        num_decode_tokens=bucket,
        max_seqlen_q=1,
        max_seqlen_k=width * block_size,  # an upper bound: the decode kernel reads seq_lens_k
        block_size=block_size,
        q_lens=[1] * bucket,
        k_lens=[width * block_size] * bucket,
    )


class SharedOutput:
    """One persistent logits buffer that every graph writes its rows into.

    Graphs never run at once and their output is read before the next replay, so one buffer of the
    largest size serves them all (a buffer per graph would hold [rows, vocab] floats per graph). It
    is allocated by the first, eager, call (the warm-up before a capture), outside the graph pool.
    """

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.buffer: torch.Tensor | None = None

    def write(self, out: torch.Tensor) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = out.new_empty(self.max_rows, *out.shape[1:])
        view = self.buffer[: out.shape[0]]
        view.copy_(out)
        return view


class CapturedGraph(Protocol):
    output: torch.Tensor

    def replay(self) -> None: ...


class GraphCapturer(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedGraph: ...


@dataclass
class _CudaGraph:
    graph: Any  # torch.cuda.CUDAGraph
    output: torch.Tensor

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphCapturer:
    """Captures with torch.cuda.CUDAGraph; every graph shares the first one's memory pool."""

    def __init__(self, device: torch.device | str, warmup_iters: int = 2) -> None:
        self.device = torch.device(device)
        self.warmup_iters = warmup_iters
        self.pool: Any = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedGraph:
        # warm up on a side stream (lazy inits, autotuning) before capturing, as torch's docs advise
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(self.warmup_iters):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        if self.pool is None:
            self.pool = graph.pool()
        torch.cuda.synchronize(self.device)
        return _CudaGraph(graph, output)


class DecodeGraphRunner:
    """Captures decode graphs at warmup and runs the decode steps that fit them.

    `forward` is the engine's model call (it prepares the backend's metadata and runs the model on
    the packed tokens); it must only use tensor ops on the metadata for the pure decode path, as the
    flash-attn backend does.
    """

    def __init__(
        self,
        forward: StepForward,
        *,
        max_requests: int,
        max_blocks_per_seq: int,
        block_size: int,
        pad_block: int,
        device: torch.device | str,
        capturer: GraphCapturer | None = None,
    ) -> None:
        self.forward = forward
        self.sizes = graph_batch_sizes(max_requests)
        self.block_size = block_size
        self.pad_block = pad_block
        self.buffers = DecodeBuffers.allocate(self.sizes[-1], max_blocks_per_seq, device)
        self.capturer = capturer or CudaGraphCapturer(device)
        self.output = SharedOutput(self.sizes[-1])
        self.graphs: dict[int, CapturedGraph] = {}
        self.replays = 0

    def _graph_step(self, bucket: int) -> Callable[[], torch.Tensor]:
        meta = graph_metadata(self.buffers, bucket, self.block_size)
        buf = self.buffers

        def step() -> torch.Tensor:
            meta.extra.clear()
            logits = self.forward(buf.input_ids[:bucket], buf.positions[:bucket], meta, buf.logits_rows[:bucket])
            return self.output.write(logits)

        return step

    @torch.inference_mode()
    def warmup(self) -> None:
        """Capture every bucket, largest first (the pool is sized by the first capture)."""
        buf = self.buffers
        for bucket in sorted(self.sizes, reverse=True):
            # capture over padding rows only: the warm-up writes land in the padding block
            buf.input_ids.zero_()
            buf.positions.zero_()
            buf.slot_mapping.fill_(self.pad_block * self.block_size)
            buf.seq_lens_k.fill_(1)
            buf.block_tables.zero_()
            buf.block_tables[:, 0].fill_(self.pad_block)
            self.graphs[bucket] = self.capturer.capture(self._graph_step(bucket))
        logger.info("captured decode graphs for batch sizes %s", sorted(self.graphs))

    def graph_for(self, meta: AttentionMetadata) -> int | None:
        """The bucket whose graph runs this step, or None (run it eagerly)."""
        if not self.graphs:
            return None
        return choose_decode_graph(meta, self.sizes, self.buffers.max_blocks_per_seq)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [num_seqs, vocab] of a decode step that `graph_for` accepted."""
        bucket = self.graph_for(meta)
        if bucket is None:
            raise ValueError("this step has no captured graph (check graph_for first)")
        fill_decode_buffers(self.buffers, bucket, input_ids, positions, meta, self.pad_block)
        graph = self.graphs[bucket]
        graph.replay()
        self.replays += 1
        return graph.output[: meta.num_seqs]
