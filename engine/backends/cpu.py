"""CPU attention over the paged cache with torch SDPA.

Decode sequences (one query each) are attended in one batched SDPA call over their gathered keys,
padded to the longest and masked. Prefill chunks are attended one sequence at a time: a chunk with
no history uses the step's own keys with a causal mask; a chunk with history gathers its keys.
No dense mask across requests is ever built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.backends.base import AttentionMetadata


def _slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots of `positions` ([..., L]) given block tables ([..., max_blocks])."""
    blocks = torch.gather(block_table.long(), -1, torch.div(positions, block_size, rounding_mode="floor"))
    return blocks * block_size + positions % block_size


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


class SDPABackend:
    name = "cpu"

    def check_config(self, block_size: int) -> None:
        pass

    def prepare(self, meta: AttentionMetadata) -> None:
        nd, bs = meta.num_decodes, meta.block_size
        if nd:
            k_lens = meta.seq_lens_k[:nd].long()
            max_len = int(max(meta.k_lens[:nd]))
            pos = torch.arange(max_len).expand(nd, max_len)
            valid = pos < k_lens[:, None]
            slots = _slots(meta.block_tables[:nd], torch.where(valid, pos, 0), bs)
            meta.extra["decode_slots"] = slots.reshape(-1)
            meta.extra["decode_shape"] = (nd, max_len)
            meta.extra["decode_valid"] = valid
            meta.extra["decode_pos"] = pos
            meta.extra["decode_qpos"] = k_lens - 1
        # prefill chunks that have history gather their keys from the cache
        history = {}
        for i in range(nd, meta.num_seqs):
            q_len, k_len = meta.q_lens[i], meta.k_lens[i]
            if k_len > q_len:
                pos = torch.arange(k_len)
                history[i] = _slots(meta.block_tables[i], pos, bs)
        meta.extra["history_slots"] = history
        meta.extra["masks"] = {}

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
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, v_cache.shape[3])
        k_flat.index_copy_(0, meta.slot_mapping, key)
        v_flat.index_copy_(0, meta.slot_mapping, value)

        gqa = query.shape[1] != num_kv_heads
        out = torch.empty(query.shape[0], query.shape[1], v_cache.shape[3], dtype=query.dtype)
        nd = meta.num_decodes
        if nd:
            b, max_len = meta.extra["decode_shape"]
            slots = meta.extra["decode_slots"]
            k = k_flat.index_select(0, slots).view(b, max_len, num_kv_heads, head_dim).transpose(1, 2)
            v = v_flat.index_select(0, slots).view(b, max_len, num_kv_heads, -1).transpose(1, 2)
            q = query[:nd].unsqueeze(2)  # [nd, H, 1, D]
            mask = self._decode_mask(meta, sliding_window)
            out[:nd] = _attention(q, k, v, mask, scaling, softcap, gqa).squeeze(2)

        cu = meta.cu_seqlens_q.tolist() if meta.num_seqs > nd else None
        for i in range(nd, meta.num_seqs):
            start, end = cu[i], cu[i + 1]
            q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            slots = meta.extra["history_slots"].get(i)
            if slots is None:  # the whole context is in this step
                k, v = key[start:end], value[start:end]
            else:
                k, v = k_flat.index_select(0, slots), v_flat.index_select(0, slots)
            k = k.transpose(0, 1).unsqueeze(0)
            v = v.transpose(0, 1).unsqueeze(0)
            if slots is None and sliding_window is None and softcap is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
            else:
                o = _attention(q, k, v, self._prefill_mask(meta, i, sliding_window), scaling, softcap, gqa)
            out[start:end] = o[0].transpose(0, 1)
        return out
