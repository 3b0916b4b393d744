"""The device boundary: what an attention backend receives and must do.

The model runner builds one `AttentionMetadata` per step. Every layer's attention call goes to the
backend's `attend`, which writes the step's new keys and values into the paged cache and attends
each sequence's queries over that sequence's own cached tokens.

Token order inside a step: sequences one after another, the pure-decode sequences (one query
token each) first, then the prefill chunks. Sequence i owns query rows
`cu_seqlens_q[i]:cu_seqlens_q[i+1]`; its queries sit at absolute positions
`seq_lens_k[i] - q_len_i ... seq_lens_k[i] - 1`, so a query at position p sees keys 0..p.

KV cache layout, per layer: `[num_blocks, block_size, num_kv_heads, head_dim]` for keys and the same
for values (flash-attn's paged layout). Token at position p of a sequence lives in block
`block_tables[i, p // block_size]`, offset `p % block_size`; its flat slot is
`block * block_size + offset`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of every new token
    cu_seqlens_q: torch.Tensor  # [B+1] int32: query offsets per sequence
    seq_lens_k: torch.Tensor  # [B] int32: tokens in the cache per sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    num_decode_tokens: int  # == num_decodes
    max_seqlen_q: int
    max_seqlen_k: int
    block_size: int
    # host-side copies, for backends that loop over sequences
    q_lens: list[int] = field(default_factory=list)
    k_lens: list[int] = field(default_factory=list)
    # anything a backend precomputes once per step in `prepare` (shared by all layers)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)


class AttentionBackend(Protocol):
    """One implementation per device family: `cpu` (C++ kernels, torch SDPA) and `cuda` (flash-attn,
    FlexAttention or SDPA).
    Backends subclass it explicitly, inheriting the defaults below."""

    name: str
    kernel: str | None = None  # the attention kernel it runs ("flash-attn", "flex", "sdpa"); None: `name` says it
    supports_graphs: bool = False  # its attend() can be captured in a CUDA graph
    ops: Any = None  # compiled CPU kernels (engine/backends/cpu_kernels.py), None elsewhere
    # the most elements one layer's K or V cache may hold (kernels with 32-bit offsets), None: no limit
    max_layer_elements: int | None = None

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens of [rows, vocab] logits (a backend may have a faster one)."""
        return logits.argmax(dim=-1)

    def logsumexp(self, logits: torch.Tensor) -> torch.Tensor:
        """log(sum(exp(row))) of each row of [rows, vocab] logits, float32 (a backend may have a faster one)."""
        return torch.logsumexp(logits.float(), dim=-1)

    def sample_race(self, logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                    keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor | None:  # fmt: skip
        """Sampled tokens in one pass (engine/sampler.py's `Race`), or None: this backend has none."""
        return None

    def check_config(self, block_size: int) -> None:
        """Raise ValueError (naming the field) for a cache geometry this backend cannot serve."""

    def prepare(self, meta: AttentionMetadata) -> None:
        """Called once per step before the forward: precompute what every layer shares (into meta.extra)."""

    def attend(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, Hkv, D] (the step's new keys)
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scaling: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:  # [T, H, D]
        """Write key/value into the cache at meta.slot_mapping, then attend.

        All of the step's writes must land before any sequence attends: with prefix caching a
        sequence may read blocks that another sequence of the same step is computing.
        """
