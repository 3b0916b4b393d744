"""CUDA graphs for prefill and mixed steps (`use_cuda_graph=(True, ...)`), captured on first use.

A varlen step is keyed by two padded sizes: its tokens (64, 128, 256, ... up to `max_batch_tokens`)
and its sequences (1, 2, 4, ... up to the request cap). The step is padded to its key:

- the padding tokens form one extra sequence whose every block-table entry is the reserved padding
  block, so their key/value writes and their attention stay inside that block (its length never
  exceeds the block-table width, or the step runs eagerly);
- sequences beyond it are empty (no query, one cached token on the padding block).

flash-attn's varlen kernel takes `max_seqlen_q` and `max_seqlen_k` as host integers; a graph bakes
them in as the key's token count and the table width (upper bounds). The graph computes the logits
of every sequence's last token; the caller picks the rows it samples.

Every key of the grid (sequences no more than tokens) is captured in `warmup`, at start-up, largest
first (the shared pool is sized by the first), up to `max_graphs`: each over a step that lives in the
padding block alone (its tokens spread over the key's sequences, every block-table entry the padding
block), so the warm-up runs before capture write nowhere else. While serving nothing is captured: a
step whose key has no graph runs eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.backends.base import AttentionMetadata
from engine.backends.cuda.graphs import (
    CapturedGraph,
    CudaGraphCapturer,
    GraphCapturer,
    SharedOutput,
    StepForward,
    bucket_for,
    graph_batch_sizes,
)

logger = logging.getLogger("cbserve.varlen_graphs")

SMALLEST_TOKEN_BUCKET = 64
DEFAULT_MAX_GRAPHS = 96  # the whole grid of an 8,192-token budget and 256 requests: 8 x 10 keys


def varlen_token_sizes(max_batch_tokens: int, smallest: int = SMALLEST_TOKEN_BUCKET) -> list[int]:
    """Padded token counts: powers of two from `smallest` below the step budget, then the budget."""
    if isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, int) or max_batch_tokens <= 0:
        raise ValueError(f"max_batch_tokens must be a positive integer, got {max_batch_tokens!r}")
    sizes, size = [], smallest
    while size < max_batch_tokens:
        sizes.append(size)
        size *= 2
    sizes.append(max_batch_tokens)
    return sizes


@dataclass(frozen=True)
class VarlenKey:
    num_tokens: int
    num_seqs: int


def choose_varlen_graph(
    meta: AttentionMetadata,
    num_tokens: int,
    token_sizes: list[int],
    seq_sizes: list[int],
    max_blocks_per_seq: int,
) -> VarlenKey | None:
    """The padded (tokens, sequences) of this step's graph, or None to run it eagerly."""
    if meta.num_seqs == 0 or meta.block_tables.shape[1] > max_blocks_per_seq:
        return None
    tokens = bucket_for(num_tokens, token_sizes)
    if tokens is None:
        return None
    num_pad = tokens - num_tokens
    if num_pad > max_blocks_per_seq * meta.block_size:
        return None  # the padding sequence would outgrow its block table
    seqs = bucket_for(meta.num_seqs + (1 if num_pad else 0), seq_sizes)
    if seqs is None:
        return None
    return VarlenKey(tokens, seqs)


@dataclass
class VarlenBuffers:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    cu_seqlens_q: torch.Tensor  # [S + 1] int32
    seq_lens_k: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, W] int32

    @classmethod
    def allocate(cls, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device | str) -> VarlenBuffers:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            input_ids=zeros(max_tokens, dtype=torch.long),
            positions=zeros(max_tokens, dtype=torch.long),
            slot_mapping=zeros(max_tokens, dtype=torch.long),
            cu_seqlens_q=zeros(max_seqs + 1, dtype=torch.int32),
            seq_lens_k=zeros(max_seqs, dtype=torch.int32),
            block_tables=zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32),
        )


def fill_varlen_buffers(
    buf: VarlenBuffers,
    key: VarlenKey,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    pad_block: int,
) -> None:
    """Copy a step into the buffers and pad it to `key` (see the module docstring)."""
    n_tok, n_seq, width, bs = input_ids.shape[0], meta.num_seqs, meta.block_tables.shape[1], meta.block_size
    T, S = key.num_tokens, key.num_seqs
    num_pad = T - n_tok
    if n_tok > T or n_seq + (1 if num_pad else 0) > S or width > buf.block_tables.shape[1]:
        raise ValueError(f"a step of {n_tok} tokens in {n_seq} sequences x {width} blocks does not fit {key}")
    buf.input_ids[:n_tok].copy_(input_ids, non_blocking=True)
    buf.positions[:n_tok].copy_(positions, non_blocking=True)
    buf.slot_mapping[:n_tok].copy_(meta.slot_mapping, non_blocking=True)
    buf.cu_seqlens_q[: n_seq + 1].copy_(meta.cu_seqlens_q, non_blocking=True)
    buf.cu_seqlens_q[n_seq + 1 : S + 1].fill_(T)
    buf.seq_lens_k[:n_seq].copy_(meta.seq_lens_k, non_blocking=True)
    buf.seq_lens_k[n_seq:S].fill_(1)
    buf.block_tables[:S].zero_()
    buf.block_tables[:n_seq, :width].copy_(meta.block_tables, non_blocking=True)
    buf.block_tables[n_seq:S].fill_(pad_block)
    if num_pad:
        offsets = torch.arange(num_pad, device=buf.input_ids.device) % bs
        buf.input_ids[n_tok:T].zero_()
        buf.positions[n_tok:T].copy_(offsets)
        buf.slot_mapping[n_tok:T].copy_(offsets + pad_block * bs)
        buf.seq_lens_k[n_seq] = num_pad


def padding_step(key: VarlenKey, block_size: int, pad_block: int, width: int, device: torch.device | str
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:  # fmt: skip
    """A step of exactly `key`'s tokens and sequences that reads and writes the padding block only:
    the tokens split as evenly as the sequences allow, each a sequence's whole history, every table
    entry the padding block (what warm-up captures over)."""
    base, extra = divmod(key.num_tokens, key.num_seqs)
    q_lens = [base + (1 if i < extra else 0) for i in range(key.num_seqs)]
    positions = torch.cat([torch.arange(q) for q in q_lens]).to(device)
    cu = torch.zeros(key.num_seqs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    meta = AttentionMetadata(
        slot_mapping=pad_block * block_size + positions % block_size,
        cu_seqlens_q=cu.to(device),
        seq_lens_k=torch.tensor(q_lens, dtype=torch.int32, device=device),
        block_tables=torch.full((key.num_seqs, width), pad_block, dtype=torch.int32, device=device),
        num_decodes=0,
        num_decode_tokens=0,
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(q_lens),
        block_size=block_size,
        q_lens=q_lens,
        k_lens=list(q_lens),
    )
    return torch.zeros(key.num_tokens, dtype=torch.long, device=device), positions, meta


def graph_metadata(buf: VarlenBuffers, key: VarlenKey, block_size: int) -> AttentionMetadata:
    """The metadata a key's graph is captured with: views of the buffers, host bounds fixed."""
    width = buf.block_tables.shape[1]
    T, S = key.num_tokens, key.num_seqs
    return AttentionMetadata(
        slot_mapping=buf.slot_mapping[:T],
        cu_seqlens_q=buf.cu_seqlens_q[: S + 1],
        seq_lens_k=buf.seq_lens_k[:S],
        block_tables=buf.block_tables[:S],
        num_decodes=0,  # every row goes through the varlen kernel
        num_decode_tokens=0,
        max_seqlen_q=T,
        max_seqlen_k=width * block_size,
        block_size=block_size,
        q_lens=[T] * S,  # host placeholders (only their count is read on the graph path)
        k_lens=[width * block_size] * S,
    )


class VarlenGraphRunner:
    def __init__(
        self,
        forward: StepForward,
        *,
        max_batch_tokens: int,
        max_requests: int,
        max_blocks_per_seq: int,
        block_size: int,
        pad_block: int,
        device: torch.device | str,
        capturer: GraphCapturer | None = None,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
    ) -> None:
        self.forward = forward
        self.token_sizes = varlen_token_sizes(max_batch_tokens)
        self.seq_sizes = graph_batch_sizes(max_requests + 1)  # room for the padding sequence
        self.block_size = block_size
        self.pad_block = pad_block
        self.max_blocks_per_seq = max_blocks_per_seq
        self.buffers = VarlenBuffers.allocate(self.token_sizes[-1], self.seq_sizes[-1], max_blocks_per_seq, device)
        self.capturer = capturer or CudaGraphCapturer(device)
        self.max_graphs = max_graphs
        self.output = SharedOutput(self.seq_sizes[-1])
        self.graphs: dict[VarlenKey, CapturedGraph] = {}
        self.replays = 0

    def _graph_step(self, key: VarlenKey) -> Callable[[], torch.Tensor]:
        meta = graph_metadata(self.buffers, key, self.block_size)
        buf = self.buffers

        def step() -> torch.Tensor:
            meta.extra.clear()
            last = (buf.cu_seqlens_q[1 : key.num_seqs + 1] - 1).long()
            logits = self.forward(buf.input_ids[: key.num_tokens], buf.positions[: key.num_tokens], meta, last)
            return self.output.write(logits)

        return step

    def key_for(self, meta: AttentionMetadata, num_tokens: int) -> VarlenKey | None:
        """The captured key this step pads to, or None (run it eagerly)."""
        key = choose_varlen_graph(meta, num_tokens, self.token_sizes, self.seq_sizes, self.max_blocks_per_seq)
        return key if key in self.graphs else None

    def warmup_keys(self) -> list[VarlenKey]:
        """The keys `warmup` captures: the grid's, largest first, each a step the padding block holds
        (its tokens fit its sequences' tables), at most `max_graphs`."""
        room = self.max_blocks_per_seq * self.block_size  # tokens one sequence's table reaches
        keys = [VarlenKey(t, s) for t in reversed(self.token_sizes) for s in reversed(self.seq_sizes)
                if s <= t and t <= s * room]  # fmt: skip
        return keys[: self.max_graphs]

    @torch.inference_mode()
    def warmup(self) -> None:
        """Capture every key of `warmup_keys` (see the module docstring); none is captured later."""
        self.graphs.clear()
        for key in self.warmup_keys():
            ids, positions, meta = padding_step(key, self.block_size, self.pad_block, self.max_blocks_per_seq,
                                                self.buffers.input_ids.device)  # fmt: skip
            fill_varlen_buffers(self.buffers, key, ids, positions, meta, self.pad_block)
            self.graphs[key] = self.capturer.capture(self._graph_step(key))
        logger.info("captured %d varlen graphs (tokens x sequences, up to %s)", len(self.graphs),
                    max(self.graphs, key=lambda k: (k.num_tokens, k.num_seqs), default=None))  # fmt: skip

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Logits of each sequence's last token [num_seqs, vocab], or None: run this step eagerly."""
        key = self.key_for(meta, input_ids.shape[0])
        if key is None:
            return None
        graph = self.graphs.get(key)
        if graph is None:
            return None  # not captured at start-up (over max_graphs, or no warmup): eagerly
        fill_varlen_buffers(self.buffers, key, input_ids, positions, meta, self.pad_block)
        graph.replay()
        self.replays += 1
        return graph.output[: meta.num_seqs]
