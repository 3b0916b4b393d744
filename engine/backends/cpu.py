"""CPU attention over the paged cache.

The whole step (decode tokens, prefill chunks, chunks with cached history) goes to cbserve's C++
kernel (engine/csrc/paged_attention_cpu.cpp) in one call, which reads keys and values in place
through the block table; decode tokens of sequences that share leading blocks attend over those
blocks together (cascade attention, see CASCADE_MIN_SEQS). Where it cannot run (no compiler, a
logit softcap, head dims that are not multiples of 16), torch does it: decode sequences in one batched call over their gathered keys,
padded to the longest and masked; prefill chunks one sequence at a time with SDPA (a chunk with no
history uses the step's own keys with a causal mask; a chunk with history gathers its keys). No
dense mask across requests is ever built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.backends.base import AttentionBackend, AttentionMetadata
from engine.backends.cpu_kernels import cpu_ops

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# decode tokens of at least this many sequences whose block tables start alike (one prompt sampled
# many times, a common system prompt) attend over the shared blocks together in the kernel (cascade
# attention); 0 turns it off
CASCADE_MIN_SEQS = 4


def _attention(q, k, v, mask, scaling, softcap, enable_gqa):
    """q [B, H, Lq, D], k/v [B, Hkv, Lk, D], mask bool [B|1, 1, Lq, Lk] (True = attend)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=enable_gqa)
    if enable_gqa and k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype), v)


def _grouped_decode_attention(q, k, v, mask, scaling):
    """One query per sequence with plain matmuls: q [B, H, D], k/v [B, Hkv, L, D], mask [B, 1, 1, L].

    torch's CPU flash kernel is the slower of the two for bf16/fp16 decode (`python
    benchmarks/attention_kernel.py` compares them); in float32 it is the faster and stays in use.
    """
    b, h, d = q.shape
    kv_heads = k.shape[1]
    scores = torch.matmul(q.view(b, kv_heads, h // kv_heads, d), k.transpose(-1, -2)) * scaling
    scores = scores.float().masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(b, h, v.shape[-1])


class SDPABackend(AttentionBackend):
    name = "cpu"

    def __init__(self, use_kernels: bool = True) -> None:
        self.ops = cpu_ops() if use_kernels else None
        self.cascade_min_seqs = CASCADE_MIN_SEQS

    def check_config(self, block_size: int) -> None:
        pass

    def prepare(self, meta: AttentionMetadata) -> None:
        nd = meta.num_decodes
        if nd:
            meta.extra["decode_lens"] = meta.seq_lens_k[:nd].long()
        # prefill chunks that have history gather their blocks from the cache
        history = {}
        bs = meta.block_size
        for i in range(nd, meta.num_seqs):
            if meta.k_lens[i] > meta.q_lens[i]:
                history[i] = meta.block_tables[i, : -(-meta.k_lens[i] // bs)].long()
        meta.extra["history_blocks"] = history
        meta.extra["masks"] = {}

    def _kernel_fits(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, softcap) -> bool:
        return (
            self.ops is not None
            and softcap is None
            and query.dtype in KERNEL_DTYPES
            and k_cache.shape[3] % 16 == 0
            and v_cache.shape[3] % 16 == 0
            and query.stride(-1) == 1
        )

    def _kernels_read(self, logits: torch.Tensor) -> bool:
        """Whether the logits kernels (argmax, logsumexp, race) take these logits as they are."""
        return self.ops is not None and logits.dtype in KERNEL_DTYPES and logits.dim() == 2 and logits.stride(1) == 1

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens [rows] from logits [rows, vocab], read in their own dtype by the kernel."""
        if self._kernels_read(logits):
            return self.ops.argmax_rows(logits)
        return logits.argmax(dim=-1)

    def logsumexp(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's logsumexp, float32, the logits read in their own dtype by the kernel (no float32
        copy of them, no temporary of their size)."""
        if self._kernels_read(logits):
            return self.ops.logsumexp_rows(logits)
        return torch.logsumexp(logits.float(), dim=-1)

    def sample_race(self, logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                    keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor | None:  # fmt: skip
        """Sampled tokens [rows] by the kernel's one-pass race (engine/csrc/sample_cpu.cpp), logits read
        in their own dtype; None where the kernels are not loaded or cannot read these logits."""
        if self._kernels_read(logits):
            return self.ops.sample_race(logits, temperature, top_p, min_p, keys, counters)
        return None

    def _decode_gather(self, meta: AttentionMetadata) -> None:
        """The torch path's gather indices and masks, built once per step on first use."""
        if "decode_blocks" in meta.extra:
            return
        nd, bs = meta.num_decodes, meta.block_size
        k_lens = meta.extra["decode_lens"]
        num_blocks = -(-max(meta.k_lens[:nd]) // bs)
        pos = torch.arange(num_blocks * bs).expand(nd, -1)
        # whole blocks are gathered (a block is one contiguous chunk): far cheaper than token slots
        meta.extra["decode_blocks"] = meta.block_tables[:nd, :num_blocks].reshape(-1).long()
        meta.extra["decode_shape"] = (nd, num_blocks * bs)
        meta.extra["decode_valid"] = pos < k_lens[:, None]
        meta.extra["decode_pos"] = pos
        meta.extra["decode_qpos"] = k_lens - 1

    def _decode_torch(self, query, k_cache, v_cache, meta, scaling, sliding_window, softcap) -> torch.Tensor:
        """Decode attention in torch: gather each sequence's blocks, pad to the longest, mask."""
        self._decode_gather(meta)
        num_kv_heads, head_dim, v_dim = k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]
        b, max_len = meta.extra["decode_shape"]
        blocks = meta.extra["decode_blocks"]
        k = k_cache.index_select(0, blocks).view(b, max_len, num_kv_heads, head_dim).transpose(1, 2)
        v = v_cache.index_select(0, blocks).view(b, max_len, num_kv_heads, v_dim).transpose(1, 2)
        mask = self._decode_mask(meta, sliding_window)
        if query.dtype != torch.float32 and softcap is None:
            return _grouped_decode_attention(query, k, v, mask, scaling)
        gqa = query.shape[1] != num_kv_heads
        return _attention(query.unsqueeze(2), k, v, mask, scaling, softcap, gqa).squeeze(2)

    def _decode_mask(self, meta: AttentionMetadata, window: int | None) -> torch.Tensor:
        key = ("decode", window)
        mask = meta.extra["masks"].get(key)
        if mask is None:
            mask = meta.extra["decode_valid"]
            if window is not None:
                mask = mask & (meta.extra["decode_pos"] > (meta.extra["decode_qpos"][:, None] - window))
            mask = mask[:, None, None, :]
            meta.extra["masks"][key] = mask
        return mask

    def _prefill_mask(self, meta: AttentionMetadata, i: int, window: int | None) -> torch.Tensor | None:
        q_len, k_len = meta.q_lens[i], meta.k_lens[i]
        key = (i, window)
        mask = meta.extra["masks"].get(key)
        if mask is None:
            q_pos = torch.arange(k_len - q_len, k_len)[:, None]
            k_pos = torch.arange(k_len)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask = mask & (k_pos > q_pos - window)
            mask = mask[None, None]
            meta.extra["masks"][key] = mask
        return mask

    def attend(self, query, key, value, k_cache, v_cache, meta, *, scaling, sliding_window=None, softcap=None):
        num_kv_heads, head_dim, v_dim = k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key)
        v_cache.view(-1, num_kv_heads, v_dim).index_copy_(0, meta.slot_mapping, value)

        out = torch.empty(query.shape[0], query.shape[1], v_dim, dtype=query.dtype)
        if self._kernel_fits(query, k_cache, v_cache, softcap):
            self.ops.paged_attention(out, query, k_cache, v_cache, meta.block_tables, meta.seq_lens_k,
                                     meta.cu_seqlens_q, scaling, sliding_window or 0, self.cascade_min_seqs)  # fmt: skip
            return out
        gqa = query.shape[1] != num_kv_heads
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode_torch(query[:nd], k_cache, v_cache, meta, scaling, sliding_window, softcap)

        cu = meta.cu_seqlens_q.tolist() if meta.num_seqs > nd else None
        for i in range(nd, meta.num_seqs):
            start, end = cu[i], cu[i + 1]
            q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            blocks = meta.extra["history_blocks"].get(i)
            if blocks is None:  # the whole context is in this step
                k, v = key[start:end], value[start:end]
            else:
                k_len = meta.k_lens[i]
                k = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:k_len]
                v = v_cache.index_select(0, blocks).view(-1, num_kv_heads, v_dim)[:k_len]
            k = k.transpose(0, 1).unsqueeze(0)
            v = v.transpose(0, 1).unsqueeze(0)
            if blocks is None and sliding_window is None and softcap is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
            else:
                o = _attention(q, k, v, self._prefill_mask(meta, i, sliding_window), scaling, softcap, gqa)
            out[start:end] = o[0].transpose(0, 1)
        return out
