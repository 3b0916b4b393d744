"""Shared by the GPU-path tests: random paged steps, and flash-attn's two kernels as torch references.

The references implement flash-attn 2's documented semantics (paged `block_table`, causal mask
aligned bottom-right, `window_size=(left, right)`, `softcap`) with plain loops in float32. They stand
in for the CUDA kernels, which cannot run on this machine, so the backend's calls into them (which
kernel, which arguments) are checked on the CPU.
"""

from __future__ import annotations

import torch

from engine.backends.base import AttentionMetadata


def make_step(
    seqs: list[tuple[int, int]],
    block_size: int,
    num_blocks: int,
    *,
    num_kv_heads: int = 2,
    num_heads: int = 4,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A step over `seqs` [(k_len, q_len)] (decodes first): query/key/value, a random cache, metadata."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-k // block_size) for k, _ in seqs]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    assert sum(need) <= num_blocks
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    width = max(need)
    block_tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    slots, q_lens, k_lens = [], [], []
    for (k_len, q_len), t in zip(seqs, tables):
        for p in range(k_len - q_len, k_len):
            slots.append(t[p // block_size] * block_size + p % block_size)
        q_lens.append(q_len)
        k_lens.append(k_len)
    num_decodes = 0
    while num_decodes < len(seqs) and q_lens[num_decodes] == 1:
        num_decodes += 1
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        cu_seqlens_q=cu,
        seq_lens_k=torch.tensor(k_lens, dtype=torch.int32),
        block_tables=block_tables,
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(k_lens),
        block_size=block_size,
        q_lens=q_lens,
        k_lens=k_lens,
    )
    total = sum(q_lens)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    query, key, value = rnd(total, num_heads, head_dim), rnd(total, num_kv_heads, head_dim), rnd(total, num_kv_heads, head_dim)
    k_cache = rnd(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = rnd(num_blocks, block_size, num_kv_heads, head_dim)
    return query, key, value, k_cache, v_cache, meta


def run_backend(backend, step, **kw):
    """One attention call of `backend` over `step` (make_step's tuple) on copies of its cache:
    (output as float32, the keys' cache, the values' cache)."""
    query, key, value, k_cache, v_cache, meta = step
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    backend.prepare(meta)
    out = backend.attend(query, key, value, k_cache, v_cache, meta, scaling=0.25, **kw)
    meta.extra.clear()
    return out.float(), k_cache, v_cache


def _attend_one(q, k, v, scale, window, softcap):
    """q [sq, H, D], k/v [sk, Hkv, D]: flash-attn's causal bottom-right semantics, float32."""
    sq, sk = q.shape[0], k.shape[0]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1).float(), v.repeat_interleave(rep, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    allowed = j <= i
    left, right = window
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def _paged(cache, table, length):
    bs = cache.shape[1]
    blocks = table[: -(-length // bs)].long()
    return cache[blocks].reshape(-1, cache.shape[2], cache.shape[3])[:length]


class FlashReference:
    """flash_attn_varlen_func / flash_attn_with_kvcache (paged, inference only), recording their calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, block_table=None):  # fmt: skip
        self.calls.append(("varlen", dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                          window_size=window_size, softcap=softcap, causal=causal)))  # fmt: skip
        assert causal and block_table is not None and cu_seqlens_k.dtype == torch.int32
        assert block_table.dtype == torch.int32 and k.shape[1] % 256 == 0, "paged kernels want pages of 256k"
        out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
        for b in range(cu_seqlens_q.numel() - 1):
            qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
            sk = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
            assert qe - qs <= max_seqlen_q and sk <= max_seqlen_k
            kk, vv = _paged(k, block_table[b], sk), _paged(v, block_table[b], sk)
            out[qs:qe] = _attend_one(q[qs:qe], kk, vv, softmax_scale, window_size, softcap).to(q.dtype)
        return out

    def kvcache(self, q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):  # fmt: skip
        self.calls.append(("kvcache", dict(window_size=window_size, softcap=softcap, causal=causal)))
        assert k is None and v is None, "cbserve writes the cache itself, by slot mapping"
        assert q.dim() == 4 and cache_seqlens.dtype == torch.int32 and block_table.dtype == torch.int32
        assert k_cache.shape[1] % 256 == 0, "page_block_size must be a multiple of 256"
        out = torch.empty_like(q)
        for b in range(q.shape[0]):
            sk = int(cache_seqlens[b])
            kk, vv = _paged(k_cache, block_table[b], sk), _paged(v_cache, block_table[b], sk)
            out[b] = _attend_one(q[b], kk, vv, softmax_scale, window_size, softcap).to(q.dtype)
        return out


def meta_for(tables: list[list[int]], k_lens: list[int], q_lens: list[int], block_size: int) -> AttentionMetadata:
    """Metadata of a step over sequences with these block tables, cache lengths and query lengths."""
    width = max(len(t) for t in tables)
    block_tables = torch.zeros(len(tables), width, dtype=torch.int32)
    slots = []
    for i, (t, k_len, q_len) in enumerate(zip(tables, k_lens, q_lens)):
        block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        slots += [t[p // block_size] * block_size + p % block_size for p in range(k_len - q_len, k_len)]
    num_decodes = 0
    while num_decodes < len(q_lens) and q_lens[num_decodes] == 1:
        num_decodes += 1
    cu = torch.zeros(len(tables) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        cu_seqlens_q=cu,
        seq_lens_k=torch.tensor(k_lens, dtype=torch.int32),
        block_tables=block_tables,
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(k_lens),
        block_size=block_size,
        q_lens=list(q_lens),
        k_lens=list(k_lens),
    )


def hf_forward(model, backend, cache):
    """The engine's model call as a StepForward: prepare the backend, run the HF model on [1, T]."""
    from engine.attention import ATTN_IMPLEMENTATION, StepContext

    def forward(input_ids, positions, meta, logits_rows):
        backend.prepare(meta)
        config = model.config
        previous = config._attn_implementation
        config._attn_implementation = ATTN_IMPLEMENTATION
        try:
            out = model(
                input_ids=input_ids[None],
                position_ids=positions[None],
                use_cache=False,
                logits_to_keep=logits_rows,
                cb_step=StepContext(backend, cache, meta),
            )
        finally:
            config._attn_implementation = previous
        return out.logits[0].float()

    return forward


class EagerGraph:
    """A 'graph' whose replay re-runs the captured function over the same buffers into the same output."""

    def __init__(self, fn, output):
        self.fn, self.output = fn, output

    def replay(self):
        self.output.copy_(self.fn())


class EagerCapturer:
    """Stands in for CUDA graph capture on the CPU: records what was captured, in order."""

    def __init__(self):
        self.order: list[int] = []

    def capture(self, fn):
        out = fn()
        self.order.append(out.shape[0])
        return EagerGraph(fn, out)
