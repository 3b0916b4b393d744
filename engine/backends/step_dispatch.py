"""How a step's forward runs: a decode CUDA graph, a compiled forward, or eagerly.

The engine's model runner builds the step (token ids, positions, metadata) and hands it to a
`StepDispatcher` instead of calling the model itself:

    dispatch = StepDispatcher.from_config(forward, config, backend, device, block_size=..., num_blocks=...,
                                          max_requests=..., max_batch_tokens=..., max_context=...)
    dispatch.warmup()                                   # captures the decode graphs (CUDA only)
    logits = dispatch(input_ids, positions, meta, logits_rows)

`forward` is the runner's eager model call (a `StepForward`). A pure decode step that fits a
captured decode graph replays it; with varlen graphs on, a prefill or mixed step replays the graph
of its padded (tokens, sequences) key (captured on first use); other steps run `forward`, compiled
with transformers' varlen or decode compile config when one is given. On the CPU, or with a backend
that cannot be captured, it is just `forward`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from engine.backends.base import AttentionBackend, AttentionMetadata
from engine.backends.compile import compile_step

if TYPE_CHECKING:  # the graph runners are imported only when graphs are on
    from engine.backends.cuda.graphs import DecodeGraphRunner, GraphCapturer, StepForward
    from engine.backends.cuda.varlen_graphs import VarlenGraphRunner

logger = logging.getLogger("cbserve.cuda_graphs")

PAD_BLOCKS = 1  # the padding block graphs' padded rows write to, allocated beyond the block manager's
# a step's route (`StepDispatcher.route`): how it runs, and which graph
VARLEN, DECODE, DECODE_GRAPH, VARLEN_GRAPH = range(4)
Route = tuple[int, int, int]


def normalize_cuda_graph_flag(value: Any, device_type: str = "cuda", backend_supports_graphs: bool = True) -> tuple[bool, bool]:
    """`use_cuda_graph` as a (varlen, decode) pair.

    None: decode graphs on CUDA when the backend can be captured, never varlen. A bool applies to
    both. Off on any device but CUDA, or with a backend that cannot be captured (with a warning
    when graphs were asked for). Anything else is a ValueError naming `use_cuda_graph`.
    """
    if value is None:
        pair = (False, True)
        requested = False
    elif isinstance(value, bool):
        pair = (value, value)
        requested = value
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, bool) for v in value):
        pair = (value[0], value[1])
        requested = any(pair)
    else:
        raise ValueError(f"use_cuda_graph must be a bool or a (varlen, decode) pair of bools, got {value!r}")
    if device_type != "cuda" or not backend_supports_graphs:
        if requested:
            why = f"the device is {device_type}" if device_type != "cuda" else "the attention backend cannot be captured"
            logger.warning("use_cuda_graph=%r ignored: %s; every step runs eagerly", value, why)
        return (False, False)
    return pair


def graph_table_width(
    num_blocks: int, block_size: int, max_context: int | None, max_blocks_per_request: int | None = None
) -> int:
    """Block-table width of the graph buffers: the most blocks one request can hold."""
    width = num_blocks
    if max_context is not None:
        width = min(width, -(-max_context // block_size))
    if max_blocks_per_request is not None:
        width = min(width, max_blocks_per_request)
    return max(1, width)


def reserved_blocks(graph_flags: tuple[bool, bool]) -> int:
    """Blocks the cache needs beyond the block manager's: the padding block when any graphs are on."""
    return PAD_BLOCKS if any(graph_flags) else 0



class StepDispatcher:
    def __init__(
        self,
        forward: StepForward,
        *,
        graph_flags: tuple[bool, bool],
        device: torch.device | str,
        max_requests: int,
        max_batch_tokens: int,
        max_blocks_per_seq: int,
        block_size: int,
        pad_block: int,
        varlen_compile_config: Any = None,
        decode_compile_config: Any = None,
        capturer: GraphCapturer | None = None,
    ) -> None:
        self.graph_flags = graph_flags
        self.varlen_forward = compile_step(
            forward, varlen_compile_config, cbserve_graphs=graph_flags[0], name="varlen_compile_config"
        )
        self.decode_forward = compile_step(
            forward, decode_compile_config, cbserve_graphs=graph_flags[1], name="decode_compile_config"
        )
        self.graphs: DecodeGraphRunner | None = None
        self.varlen_graphs: VarlenGraphRunner | None = None
        if any(graph_flags):
            from engine.backends.cuda.graphs import CudaGraphCapturer, DecodeGraphRunner
            from engine.backends.cuda.varlen_graphs import VarlenGraphRunner

            if capturer is None:
                capturer = CudaGraphCapturer(device)  # one capturer: every graph in one memory pool
        if graph_flags[0]:
            self.varlen_graphs = VarlenGraphRunner(
                self.varlen_forward,
                max_batch_tokens=max_batch_tokens,
                max_requests=max_requests,
                max_blocks_per_seq=max_blocks_per_seq,
                block_size=block_size,
                pad_block=pad_block,
                device=device,
                capturer=capturer,
            )
        if graph_flags[1]:
            self.graphs = DecodeGraphRunner(
                self.decode_forward,
                max_requests=max_requests,
                max_blocks_per_seq=max_blocks_per_seq,
                block_size=block_size,
                pad_block=pad_block,
                device=device,
                capturer=capturer,
            )

    @classmethod
    def from_config(
        cls,
        forward: StepForward,
        config: Any,
        backend: AttentionBackend,
        device: torch.device | str,
        *,
        block_size: int,
        num_blocks: int,
        max_requests: int,
        max_batch_tokens: int,
        max_context: int | None,
        graph_flags: tuple[bool, bool] | None = None,
    ) -> StepDispatcher:
        """From a ContinuousBatchingConfig and the engine's resolved sizes.

        `num_blocks` are the block manager's; the padding block follows them in the cache.
        """
        device = torch.device(device)
        flags = graph_flags
        if flags is None:
            flags = normalize_cuda_graph_flag(getattr(config, "use_cuda_graph", None), device.type, backend.supports_graphs)
        return cls(
            forward,
            graph_flags=flags,
            device=device,
            max_requests=max_requests,
            max_batch_tokens=max_batch_tokens,
            max_blocks_per_seq=graph_table_width(
                num_blocks, block_size, max_context, getattr(config, "max_blocks_per_request", None)
            ),
            block_size=block_size,
            pad_block=num_blocks,
            varlen_compile_config=getattr(config, "varlen_compile_config", None),
            decode_compile_config=getattr(config, "decode_compile_config", None),
        )

    @property
    def reserved_blocks(self) -> int:
        """Blocks to allocate in the cache beyond the block manager's (the padding block)."""
        return reserved_blocks(self.graph_flags)

    @property
    def replays(self) -> int:
        """Steps that ran as a graph replay so far."""
        return sum(r.replays for r in (self.graphs, self.varlen_graphs) if r is not None)

    def warmup(self) -> None:
        """Capture every graph now (decode buckets, then the varlen grid): none is captured while serving."""
        if self.graphs is not None and not self.graphs.graphs:
            self.graphs.warmup()
        if self.varlen_graphs is not None and not self.varlen_graphs.graphs:
            self.varlen_graphs.warmup()

    @property
    def captured(self) -> int:
        """Graphs captured so far, both kinds."""
        return sum(len(r.graphs) for r in (self.graphs, self.varlen_graphs) if r is not None)

    def recapture(self) -> None:
        """Capture again what was captured (the model's weights are new tensors: graphs read the old ones)."""
        for runner in (self.graphs, self.varlen_graphs):
            if runner is not None and runner.graphs:
                runner.graphs.clear()
                runner.warmup()

    def route(self, meta: AttentionMetadata, num_tokens: int) -> Route:
        """How a step runs: (DECODE_GRAPH, bucket, 0), (DECODE, 0, 0), (VARLEN_GRAPH, tokens, sequences)
        or (VARLEN, 0, 0). Tensor-parallel ranks compare theirs with rank 0's each step."""
        if self.graphs is not None and (bucket := self.graphs.graph_for(meta)) is not None:
            return (DECODE_GRAPH, bucket, 0)
        if meta.num_decodes == meta.num_seqs:
            return (DECODE, 0, 0)
        if self.varlen_graphs is not None and (key := self.varlen_graphs.key_for(meta, num_tokens)) is not None:
            return (VARLEN_GRAPH, key.num_tokens, key.num_seqs)
        return (VARLEN, 0, 0)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, logits_rows: torch.Tensor
    ) -> torch.Tensor:
        how = self.route(meta, input_ids.shape[0])[0]
        if how == DECODE_GRAPH and self.graphs is not None:
            # one token per row in a decode step: the rows that sample index the graph's output directly
            return self.graphs.run(input_ids, positions, meta).index_select(0, logits_rows)
        if how == DECODE:
            return self.decode_forward(input_ids, positions, meta, logits_rows)
        if how == VARLEN_GRAPH and self.varlen_graphs is not None:
            per_seq = self.varlen_graphs.run(input_ids, positions, meta)
            if per_seq is not None:
                # logits_rows are last-token indices of sampling sequences: find their sequences
                last = meta.cu_seqlens_q[1:].long() - 1
                return per_seq.index_select(0, torch.searchsorted(last, logits_rows.long()))
        return self.varlen_forward(input_ids, positions, meta, logits_rows)
