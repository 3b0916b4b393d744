"""torch SDPA over the paged cache, on any device: the CUDA backend of last resort (no flash-attn, no
FlexAttention), and the reference FlexAttention's start-up self-check compares against. `write_kv`,
the slot-mapped cache write every CUDA backend does first, lives here too."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.backends.base import AttentionBackend, AttentionMetadata


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write the step's keys/values [T, Hkv, D] into the paged cache at their flat slots."""
    k_cache.view(-1, k_cache.shape[2], k_cache.shape[3]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, v_cache.shape[2], v_cache.shape[3]).index_copy_(0, slot_mapping, value)



def _sdpa(q, k, v, mask, scaling, softcap):
    """q [B, H, Lq, D], k/v [B, Hkv, Lk, D], mask bool [B, 1, Lq, Lk] (True = attend)."""
    gqa = q.shape[1] != k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    # In float32 throughout, as flash-attn applies its softcap: tanh over bfloat16 scores alone was
    # 3 bfloat16 ulps off (0.023) on an H200 at head dim 64.
    scores = torch.tanh(torch.matmul(q.float(), k.float().transpose(-1, -2)) * (scaling / softcap)) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(v.dtype)


class SDPACudaBackend(AttentionBackend):
    """torch SDPA over the paged cache, device-agnostic (used on CUDA when flash-attn is missing).

    Decode rows are attended together over their block tables' full width with a length mask: only
    tensor ops with static shapes. Prefill chunks are attended one sequence at a time over their
    own blocks with a bottom-right causal mask.
    """

    name = "cuda-sdpa"
    kernel = "sdpa"
    # Its decode path is shape-static, but it gathers every row's whole block-table width: off by default.
    supports_graphs = False

    def check_config(self, block_size: int) -> None:
        pass

    def prepare(self, meta: AttentionMetadata) -> None:
        nd, bs = meta.num_decodes, meta.block_size
        device = meta.block_tables.device
        if nd:
            width = meta.block_tables.shape[1] * bs
            pos = torch.arange(width, device=device)
            k_lens = meta.seq_lens_k[:nd].long()
            meta.extra["decode_blocks"] = meta.block_tables[:nd].reshape(-1).long()
            meta.extra["decode_width"] = width
            meta.extra["decode_valid"] = pos[None, :] < k_lens[:, None]
            meta.extra["decode_pos"] = pos
            meta.extra["decode_qpos"] = k_lens - 1
        starts = [0]
        for n in meta.q_lens:
            starts.append(starts[-1] + n)
        meta.extra["q_starts"] = starts

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata, *, scaling: float, sliding_window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:  # fmt: skip
        write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        hkv, d, dv = k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]
        out = torch.empty(query.shape[0], query.shape[1], dv, dtype=query.dtype, device=query.device)
        nd, bs = meta.num_decodes, meta.block_size
        if nd:
            width, blocks = meta.extra["decode_width"], meta.extra["decode_blocks"]
            k = k_cache.index_select(0, blocks).view(nd, width, hkv, d).transpose(1, 2)
            v = v_cache.index_select(0, blocks).view(nd, width, hkv, dv).transpose(1, 2)
            mask = meta.extra["decode_valid"]
            if sliding_window is not None:
                mask = mask & (meta.extra["decode_pos"][None, :] > meta.extra["decode_qpos"][:, None] - sliding_window)
            out[:nd] = _sdpa(query[:nd].unsqueeze(2), k, v, mask[:, None, None, :], scaling, softcap).squeeze(2)
        starts = meta.extra["q_starts"]
        for i in range(nd, meta.num_seqs):
            start, end = starts[i], starts[i + 1]
            q_len, k_len = meta.q_lens[i], meta.k_lens[i]
            blocks = meta.block_tables[i, : -(-k_len // bs)].long()
            k = k_cache.index_select(0, blocks).view(-1, hkv, d)[:k_len].transpose(0, 1).unsqueeze(0)
            v = v_cache.index_select(0, blocks).view(-1, hkv, dv)[:k_len].transpose(0, 1).unsqueeze(0)
            q_pos = torch.arange(k_len - q_len, k_len, device=query.device)[:, None]
            k_pos = torch.arange(k_len, device=query.device)[None, :]
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask = mask & (k_pos > q_pos - sliding_window)
            q = query[start:end].transpose(0, 1).unsqueeze(0)
            out[start:end] = _sdpa(q, k, v, mask[None, None], scaling, softcap)[0].transpose(0, 1)
        return out
