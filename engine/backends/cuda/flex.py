"""Paged attention with torch's FlexAttention: the CUDA path when flash-attn is missing or not built
for this GPU. It needs nothing beyond torch and triton, and it can be captured in CUDA graphs.

Keys and values are the physical cache itself, flattened to `[1, Hkv, num_slots, D]` (no copy); a
BlockMask says which 128-slot tiles of it each query tile visits, and a `mask_mod` says which
slots inside them a query may see:

- `logical_blocks`: per sequence, the logical index of each physical block of its table (-1 for
  blocks it does not hold). A key at slot j of physical block b sits at position
  `logical[s, b] * block_size + j % block_size` of sequence s; a query at position p of s sees it
  iff that block is s's and the position is <= p (and within the sliding window).
- **decode rows** (one query each) are a batch: query `[n, H, 1, D]`, the cache broadcast over the
  batch, row i's BlockMask row listing its table's tiles in order (`decode_layout`).
- **prefill chunks** are packed into `[1, H, T', D]` with each sequence starting on a fresh
  128-row query tile (`prefill_layout`), so every query tile belongs to one sequence and visits
  only that sequence's tiles up to its last position.
- layers with a sliding window get their own BlockMask, without the tiles wholly before the window.

Everything per step is built from the metadata's tensors with tensor ops whose shapes follow host
integers the step already has (token count, sequence count, table width): no host sync, so a step
can be captured in a CUDA graph. `flex_attention` itself must be compiled on a GPU (eager it
materialises every score); on the CPU the tests run it eagerly against the CPU backend.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.backends.base import AttentionBackend, AttentionMetadata
from engine.backends.cuda.sdpa import write_kv

logger = logging.getLogger("cbserve.backends.cuda")

TILE = 128  # flex's default sparse block: query tiles and key tiles of the BlockMask


def flex_unavailable() -> str | None:
    """Why FlexAttention cannot serve on this machine (None: it can)."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError as exc:
        return f"torch {torch.__version__} has no FlexAttention ({exc})"
    params = inspect.signature(BlockMask.from_kv_blocks).parameters
    if "seq_lengths" not in params or "compute_q_blocks" not in params:
        return f"torch {torch.__version__}'s BlockMask.from_kv_blocks lacks seq_lengths/compute_q_blocks"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (torch.compile's GPU kernels need it)"
    return None


def logical_blocks(block_tables: torch.Tensor, seq_lens_k: torch.Tensor, block_size: int, num_blocks: int
                   ) -> torch.Tensor:  # fmt: skip
    """[S, num_blocks + 1] int32: logical index of each physical block in each sequence's table, -1
    where the sequence does not hold it (the last column takes the table's padding entries)."""
    S, W = block_tables.shape
    device = block_tables.device
    cols = torch.arange(W, dtype=torch.int32, device=device).expand(S, W)
    held = cols < ((seq_lens_k.long() + block_size - 1) // block_size)[:, None]
    index = torch.where(held, block_tables.long(), num_blocks)
    out = torch.full((S, num_blocks + 1), -1, dtype=torch.int32, device=device)
    return out.scatter_(1, index, cols.contiguous())


def table_tiles(block_tables: torch.Tensor, block_size: int, key_tiles: int) -> torch.Tensor:
    """[S, key_tiles] int32: the key tiles of each table in logical order, then zeros. A BlockMask's
    rows span every key tile of the cache, as torch's own paged attention builds them (the CPU
    template asserts it; narrower rows are not what the kernels are tested with)."""
    S, W = block_tables.shape
    per_block = block_size // TILE
    sub = torch.arange(W * per_block, device=block_tables.device)
    out = torch.zeros(S, key_tiles, dtype=torch.int32, device=block_tables.device)
    out[:, : W * per_block] = block_tables[:, sub // per_block].long() * per_block + sub % per_block
    return out


def visited_tiles(tiles: torch.Tensor, first_pos: torch.Tensor, last_pos: torch.Tensor, window: int | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """BlockMask rows (kv_num_blocks [R] int32, kv_indices [R, key tiles]) of query tiles whose queries
    sit at positions first_pos..last_pos, over their sequences' `tiles` (logical order): the key tiles
    from the first one a query may see (position first_pos - window + 1; 0 without a window) to the
    one holding last_pos."""
    last = torch.div(last_pos, TILE, rounding_mode="floor")
    if window is None:
        return (last + 1).to(torch.int32), tiles
    lo = torch.div((first_pos - window + 1).clamp(min=0), TILE, rounding_mode="floor")
    cols = (lo[:, None] + torch.arange(tiles.shape[1], device=tiles.device)).clamp_(max=tiles.shape[1] - 1)
    return (last - lo + 1).to(torch.int32), tiles.gather(1, cols)


@dataclass
class DecodeLayout:
    tiles: torch.Tensor  # [n, key tiles of the cache] int32: each row's table as key tiles
    q_pos: torch.Tensor  # [n] int64: each row's position

    def blocks(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv_num_blocks [n, 1, 1], kv_indices [n, 1, 1, key tiles]) for layers with this window."""
        num, indices = visited_tiles(self.tiles, self.q_pos, self.q_pos, window)
        n = self.q_pos.shape[0]
        return num.view(n, 1, 1), indices.view(n, 1, 1, -1)


def decode_layout(meta: AttentionMetadata, n: int, key_tiles: int) -> DecodeLayout:
    """The first n sequences, one query each: row i visits its own table's tiles up to its length."""
    return DecodeLayout(table_tiles(meta.block_tables[:n], meta.block_size, key_tiles), meta.seq_lens_k[:n].long() - 1)


@dataclass
class PrefillLayout:
    rows: int  # padded query rows, a multiple of TILE
    dest: torch.Tensor  # [T] int64: the padded row of each prefill token
    row_seq: torch.Tensor  # [rows] int64: sequence (index into the step's sequences) of each row
    row_pos: torch.Tensor  # [rows] int64: position of each row's query (padding rows run past the chunk)
    tiles: torch.Tensor  # [rows // TILE, key tiles of the cache] int32: each query tile's sequence's table
    tile_first: torch.Tensor  # [rows // TILE] int64: position of each query tile's first query
    tile_last: torch.Tensor  # [rows // TILE] int64: the last position its queries see
    used: torch.Tensor  # [rows // TILE] bool: the tile holds queries

    def blocks(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv_num_blocks [1, 1, tiles], kv_indices [1, 1, tiles, key tiles]) for layers with this window."""
        num, indices = visited_tiles(self.tiles, self.tile_first, self.tile_last, window)
        num = torch.where(self.used, num, 0).to(torch.int32)
        return num.view(1, 1, -1), indices.view(1, 1, num.shape[0], -1)


def prefill_layout(meta: AttentionMetadata, first: int, num_tokens: int, key_tiles: int) -> PrefillLayout:
    """Sequences first.. (their tokens first.. of the step, `num_tokens` in all) packed so that
    each starts on a fresh query tile. The tile count is bounded by host integers (tokens / TILE
    rounded up, plus one per sequence); tiles past the last sequence visit nothing."""
    device = meta.seq_lens_k.device
    num_seqs = meta.num_seqs - first
    cu = meta.cu_seqlens_q[first:].long() - first
    q_lens = cu[1:] - cu[:-1]
    k_lens = meta.seq_lens_k[first:].long()
    seq_tiles = (q_lens + TILE - 1) // TILE
    tile_end = torch.cumsum(seq_tiles, 0)
    tile_start = tile_end - seq_tiles
    num_tiles = -(-num_tokens // TILE) + num_seqs
    tiles = torch.arange(num_tiles, device=device)
    tile_seq = torch.searchsorted(tile_end, tiles, right=True).clamp_(max=num_seqs - 1)
    start_pos = k_lens - q_lens  # position of each chunk's first query
    tile_first = start_pos[tile_seq] + (tiles - tile_start[tile_seq]) * TILE
    # the last key a tile's queries reach: its last row's position, at most the sequence's last
    tile_last = torch.minimum(tile_first + TILE - 1, k_lens[tile_seq] - 1)
    rows = torch.arange(num_tiles * TILE, device=device)
    row_seq = tile_seq[rows // TILE]
    row_pos = start_pos[row_seq] + rows - tile_start[row_seq] * TILE
    tokens = torch.arange(num_tokens, device=device)
    token_seq = torch.searchsorted(cu[1:], tokens, right=True)
    dest = tile_start[token_seq] * TILE + tokens - cu[token_seq]
    seq_tables = table_tiles(meta.block_tables[first:], meta.block_size, key_tiles)
    return PrefillLayout(num_tiles * TILE, dest, row_seq + first, row_pos, seq_tables[tile_seq], tile_first, tile_last,
                         tiles < tile_end[-1])  # fmt: skip


def paged_mask(logical: torch.Tensor, block_size: int, q_seq: Callable[[Any, Any], Any],
               q_pos: Callable[[Any, Any], Any], sliding_window: int | None) -> Callable[..., Any]:  # fmt: skip
    """The mask_mod: the query (b, q) of sequence q_seq(b, q) at position q_pos(b, q) sees key slot kv
    iff kv's block is that sequence's and its position is at most the query's (within the window)."""

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        seq, pos = q_seq(b, q), q_pos(b, q)
        index = logical[seq, kv // block_size]
        key_pos = index * block_size + kv % block_size
        ok = (index >= 0) & (key_pos <= pos)
        if sliding_window is not None:
            ok = ok & (pos - key_pos < sliding_window)
        return ok

    return mask_mod


def softcap_mod(softcap: torch.Tensor) -> Callable[..., Any]:
    """The score_mod of a softcap held as a 0-d tensor on the query's device. Not a Python float: under
    `dynamic=True` dynamo turns a float the function closes over into a CPU scalar read with `.item()`,
    and inductor's flex lowering fails on it ("unbacked_bindings": torch 2.11 on an H200, and torch
    2.13 on the CPU); a captured tensor is one more buffer the kernel reads."""

    def score_mod(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return torch.tanh(score / softcap) * softcap

    return score_mod


# Kernel tiles to try, in order: torch's own choice first, then smaller ones. On an H200 (torch 2.11)
# torch's bfloat16 tiles for head dim 64 asked for 240 KiB of shared memory, over the 227 KiB a
# block may have ("No valid triton configs ... out of resource"): the backend steps down then.
KERNEL_OPTIONS: tuple[dict[str, int], ...] = (
    {},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2},
    {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1},
)


TOO_BIG = ("out of resource", "No valid triton configs")  # what triton and inductor say when tiles do not fit


def out_of_resources(exc: BaseException) -> bool:
    """Whether a flex_attention failure is its kernel's tiles not fitting the GPU (smaller ones may)."""
    return any(mark in str(exc) for mark in TOO_BIG)


def resource_line(exc: BaseException) -> str:
    """The line of an out-of-resources failure that says what did not fit."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = [line for line in lines if any(mark in line for mark in TOO_BIG)]
    return (named or lines or [type(exc).__name__])[0][:200]


RECOMPILE_LIMIT = 64  # dynamo's per-function cache (8 by default) would refuse the variants past it


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, **kw)


# One function per entry of KERNEL_OPTIONS, its options written in as constants. Dynamo keeps one cache
# per code object: had they shared one (a closure over the options), a second choice would have
# changed the "same" integers, automatic dynamic would have made them symbols, and inductor's lowering
# fails on symbolic tile sizes ("unbacked_bindings", torch 2.11 on an H200).
def _flex_torch_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    return _flex(q, k, v, **kw)


def _flex_tiles_64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    return _flex(q, k, v, kernel_options={"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2}, **kw)


def _flex_tiles_32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    return _flex(q, k, v, kernel_options={"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1}, **kw)


TILE_FUNCTIONS: tuple[Callable[..., torch.Tensor], ...] = (_flex_torch_tiles, _flex_tiles_64, _flex_tiles_32)


def compiled_flex_attention(choice: int = 0) -> Callable[..., torch.Tensor]:
    """flex_attention compiled (the GPU kernels) with KERNEL_OPTIONS[choice]'s tiles. Shapes are
    dynamic, so steps of every size share a compilation; what still compiles anew is each kind (decode
    rows, prefill tiles) with each window and softcap a model's layers use, and sizes of 1 (dynamo
    specialises them). With fullgraph a variant past dynamo's recompile limit would be an error: the
    limit is raised."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(TILE_FUNCTIONS[choice], fullgraph=True, dynamic=True)


def self_check(device: torch.device | str, flex_fn: Callable[..., torch.Tensor] | None = None,
               dtype: torch.dtype = torch.bfloat16, backend: FlexAttnBackend | None = None) -> str | None:  # fmt: skip
    """Run the backend (`backend`, else a new one over `flex_fn`) once on `device` over a small paged
    step (two decode rows, a prompt, a chunk with history; 4 query heads over 2 KV heads) against
    torch SDPA over the same cache: None when they agree, else why not (a compile error, a kernel
    error, or the largest difference). Tiles too big for the GPU step `backend` down to ones that fit."""
    from engine.backends.cuda.sdpa import SDPACudaBackend

    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    bs, num_blocks, hkv, h, d = 256, 8, 2, 4, 64
    lens = [(300, 1), (40, 1), (130, 130), (400, 140)]  # (cache length after the step, queries)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, at = [], [], 0
    for k_len, q_len in lens:
        need = -(-k_len // bs)
        tables.append(order[at : at + need])
        at += need
        slots += [tables[-1][p // bs] * bs + p % bs for p in range(k_len - q_len, k_len)]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q_lens = [q for _, q in lens]
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(q_lens), 0).tolist(), dtype=torch.int32)

    def meta() -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=device), cu_seqlens_q=cu.to(device),
            seq_lens_k=torch.tensor([k for k, _ in lens], dtype=torch.int32, device=device),
            block_tables=block_tables.to(device), num_decodes=2, num_decode_tokens=2,
            max_seqlen_q=max(q_lens), max_seqlen_k=max(k for k, _ in lens), block_size=bs,
            q_lens=q_lens, k_lens=[k for k, _ in lens],
        )  # fmt: skip

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    T = sum(q_lens)
    q, k, v = rnd(T, h, d), rnd(T, hkv, d), rnd(T, hkv, d)
    k_cache, v_cache = rnd(num_blocks, bs, hkv, d), rnd(num_blocks, bs, hkv, d)
    try:
        with torch.inference_mode():
            flex = backend or FlexAttnBackend(flex_fn)
            got = flex.attend(q, k, v, k_cache.clone(), v_cache.clone(), meta(), scaling=d**-0.5)
            sdpa, reference = SDPACudaBackend(), meta()
            sdpa.prepare(reference)
            want = sdpa.attend(q, k, v, k_cache, v_cache, reference, scaling=d**-0.5)
    except Exception as exc:  # noqa: BLE001  (any failure means: do not serve with it)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"its self-check on {device} failed: {type(exc).__name__}: {first}"
    diff = (got.float() - want.float()).abs().max().item()
    if not diff <= 2e-2:
        return f"its self-check on {device} differs from SDPA by {diff:.3g} (over 2e-2)"
    return None


class FlexAttnBackend(AttentionBackend):
    """FlexAttention over the paged cache (see the module docstring); any block size that is a
    multiple of 128, float16, bfloat16 or float32, sliding window and softcap.

    `flex_fn` is the attention call: compiled flex_attention by default (built here, on first use),
    eager flex_attention in the CPU tests.
    """

    name = "cuda-flex"
    kernel = "flex"
    supports_graphs = True
    # triton's offsets into the [1, Hkv, slots, D] view are 32-bit: past this, an illegal memory access
    # (the sampling check's 2-layer test model on an H200, its cache sized from 90% of 140 GiB)
    max_layer_elements = 2**31 - 1

    def __init__(self, flex_fn: Callable[..., torch.Tensor] | None = None) -> None:
        self._given = flex_fn  # called with kernel_options=; else compiled_flex_attention per tile choice
        self._flex: Callable[..., torch.Tensor] | None = None
        self._tiles = 0  # index into KERNEL_OPTIONS
        self._softcaps: dict[tuple[float, torch.device], Callable[..., Any]] = {}

    def _softcap_mod(self, softcap: float, device: torch.device) -> Callable[..., Any]:
        """One score_mod per softcap and device, made on the first (eager) call and reused: the same
        function and buffer at every later call and inside CUDA graph captures."""
        key = (float(softcap), device)
        if key not in self._softcaps:
            self._softcaps[key] = softcap_mod(torch.tensor(float(softcap), dtype=torch.float32, device=device))
        return self._softcaps[key]

    @property
    def kernel_options(self) -> dict[str, int]:
        return KERNEL_OPTIONS[self._tiles]

    def _call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        """flex_attention with the current tiles; tiles too big for the GPU step down (one warning)
        and the call is made again. Compilation happens on a step's first, eager call (warm-up), never
        inside a CUDA graph capture."""
        while True:
            options = self.kernel_options
            if self._flex is None:
                if self._given is not None:
                    given = self._given
                    self._flex = lambda *a, **more: given(*a, kernel_options=dict(options) if options else None, **more)
                else:
                    self._flex = compiled_flex_attention(self._tiles)
            try:
                return self._flex(q, k, v, **kw)
            except Exception as exc:
                if not out_of_resources(exc) or self._tiles + 1 >= len(KERNEL_OPTIONS):
                    raise
                self._tiles += 1
                self._flex = None
                logger.warning("cbserve: FlexAttention's kernel tiles do not fit this GPU (%s); using smaller ones: %s",
                               resource_line(exc), KERNEL_OPTIONS[self._tiles])  # fmt: skip

    def check_config(self, block_size: int) -> None:
        if block_size % TILE:
            raise ValueError(
                f"block_size must be a multiple of {TILE} for the FlexAttention backend (its key tiles are "
                f"{TILE} slots and must not cross a block), got {block_size}; use 256 (the default)"
            )

    def _step(self, meta: AttentionMetadata, num_tokens: int, num_blocks: int) -> dict[str, Any]:
        """What every layer of the step shares: the logical map and the two layouts (built by the first layer)."""
        step = meta.extra.get("flex")
        if step is None:
            nd, key_tiles = meta.num_decodes, num_blocks * meta.block_size // TILE
            step = {"logical": logical_blocks(meta.block_tables, meta.seq_lens_k, meta.block_size, num_blocks)}
            if nd:
                step["decode"] = decode_layout(meta, nd, key_tiles)
            if nd < meta.num_seqs:
                step["prefill"] = prefill_layout(meta, nd, num_tokens - nd, key_tiles)
            meta.extra["flex"] = step
        return step

    @staticmethod
    def _blocks(step: dict[str, Any], kind: str, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A layout's BlockMask tensors for layers with this window, built by the first such layer of the step."""
        key = f"{kind} blocks {window}"
        if key not in step:
            step[key] = step[kind].blocks(window)
        return step[key]

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata, *, scaling: float, sliding_window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:  # fmt: skip
        from torch.nn.attention.flex_attention import BlockMask

        write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        num_blocks, bs, hkv = k_cache.shape[0], meta.block_size, k_cache.shape[2]
        slots = num_blocks * bs
        k = k_cache.view(slots, hkv, k_cache.shape[3]).transpose(0, 1).unsqueeze(0)  # [1, Hkv, slots, D], a view
        v = v_cache.view(slots, hkv, v_cache.shape[3]).transpose(0, 1).unsqueeze(0)
        step = self._step(meta, query.shape[0], num_blocks)
        logical = step["logical"]
        score_mod = self._softcap_mod(softcap, query.device) if softcap else None
        gqa = query.shape[1] != hkv
        out = query.new_empty(query.shape[0], query.shape[1], v_cache.shape[3])
        nd = meta.num_decodes
        if nd:
            dec: DecodeLayout = step["decode"]
            q_pos = dec.q_pos
            mask = paged_mask(logical, bs, lambda b, q: b, lambda b, q: q_pos[b], sliding_window)
            num, indices = self._blocks(step, "decode", sliding_window)
            block_mask = BlockMask.from_kv_blocks(num, indices, BLOCK_SIZE=TILE, mask_mod=mask, seq_lengths=(1, slots),
                                                  compute_q_blocks=False)  # fmt: skip
            o = self._call(query[:nd].unsqueeze(2), k, v, score_mod=score_mod, block_mask=block_mask, scale=scaling,
                           enable_gqa=gqa)  # fmt: skip
            out[:nd] = o.squeeze(2)
        if nd < meta.num_seqs:
            pre: PrefillLayout = step["prefill"]
            row_seq, row_pos = pre.row_seq, pre.row_pos
            mask = paged_mask(logical, bs, lambda b, q: row_seq[q], lambda b, q: row_pos[q], sliding_window)
            num, indices = self._blocks(step, "prefill", sliding_window)
            block_mask = BlockMask.from_kv_blocks(num, indices, BLOCK_SIZE=TILE, mask_mod=mask,
                                                  seq_lengths=(pre.rows, slots), compute_q_blocks=False)  # fmt: skip
            q = query.new_zeros(1, query.shape[1], pre.rows, query.shape[2])
            q[0].index_copy_(1, pre.dest, query[nd:].transpose(0, 1))
            o = self._call(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scaling, enable_gqa=gqa)
            out[nd:] = o[0].index_select(1, pre.dest).transpose(0, 1)
        return out
