"""Linear layers and token embeddings on GGUF-quantized weights, kept in the file's blocks.

A `QuantizedLinear` holds a weight as the GGUF file has it: each output row a run of blocks of 32
weights (Q8_0: a float16 scale and 32 int8; Q4_0: a float16 scale and 32 nibbles; Q4_1: a float16
scale, a float16 minimum and 32 nibbles), 8.5, 4.5 and 5 bits a weight, or in K-quant super-blocks
of 256 (Q4_K, 4.5 bits; Q6_K, 6.56 bits; engine/csrc/kquant_cpu.cpp has their layouts, and
`kquant_linear` their product, the same two ways as below). Its product is
engine/csrc/quant_cpu.cpp's `quant_linear`: each block dequantized in registers and multiplied into
the float32 input rows, so the result is the input times the dequantized weight up to the order of
the float sums. Steps of more than `DEQUANTIZE_ROWS` rows dequantise the weight for the call
instead and run torch's product (the same result up to the order of sums). `int8_activations` (off by default) takes llama.cpp's way instead: the input rows
quantized to int8 blocks of 32 and integer dot products (VNNI where the build has it), faster, but
its rounding of the input makes greedy output depart from `model.generate` now and then; on a
build with int8 tiles (AVX512-VNNI: 16 rows a tile; AVX2: 8) it also repacks each weight once, at
that switch, into the tiles' own layout (`REPACKED` added to the type; quant_cpu.cpp's quant_repack,
kquant_cpu.cpp's for Q4_K/Q6_K: the same size, no gather or transpose left for the product). A
`QuantizedEmbedding` holds the
token embedding the same way and dequantizes the rows it looks up; a model with tied embeddings
gets a `QuantizedLinear` LM head on the same bytes. A `QuantizedLinear` with an `out_order` keeps
its rows in the file's order and moves its outputs (Llama's q/k, whose rows llama.cpp's converter
permuted): the file's bytes stay where they are, unwritten.

The modules replace the model's own (engine/gguf_loader.py), so `model.generate` and the engine run
the same products. Without cbserve's kernels they dequantize in torch on every call (correct, slow:
the loader dequantizes at load time instead when the kernels are missing).
"""

from __future__ import annotations

from types import ModuleType

import torch

BLOCK = 32
# products of more rows than this (prompt steps) dequantise the weight into a float copy for the
# call and run torch's matmul, which then costs little beside the product; fewer rows (decode) run
# the block kernel. `python benchmarks/gguf_native.py kernels` measures both sides.
DEQUANTIZE_ROWS = 32
Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = 2, 3, 8, 12, 14  # ggml's type numbers
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q6_K: "Q6_K"}
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34, Q4_K: 144, Q6_K: 210}
K_QUANTS = frozenset((Q4_K, Q6_K))  # super-blocks of 256 weights, engine/csrc/kquant_cpu.cpp
SUPER = 256
# added to a type: the blocks repacked for the int8 tiles (quant_cpu.cpp's quant_repack); only the
# int8 product and the kernels' dequantization read them
REPACKED = 256
REPACKABLE = frozenset((Q4_0, Q4_1, Q8_0, Q4_K, Q6_K))


def base_type(qtype: int) -> int:
    """The GGUF type of blocks, repacked or not."""
    return qtype & ~REPACKED


def block_weights(qtype: int) -> int:
    return SUPER if qtype in K_QUANTS else BLOCK


def row_bytes(qtype: int, k: int) -> int:
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"GGUF type {qtype} is not one of {sorted(NAMES.values())}")
    if k % block_weights(qtype):
        raise ValueError(f"rows of {k} weights are not whole {NAMES[qtype]} blocks of {block_weights(qtype)}")
    return k // block_weights(qtype) * BLOCK_BYTES[qtype]


def _half(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _dequantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    """[..., 144] super-blocks -> [..., 256] floats: w = d sc_j q - dmin m_j per sub-block j of 32."""
    d, dmin, s = _half(b[..., 0:2]), _half(b[..., 2:4]), b[..., 4:16]
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], dim=-1).float()
    m = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1).float()
    qs = b[..., 16:].reshape(*b.shape[:-1], 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-2).reshape(*b.shape[:-1], 8, 32).float()  # sub-blocks 2i, 2i+1
    return ((d * sc).unsqueeze(-1) * q - (dmin * m).unsqueeze(-1)).reshape(*b.shape[:-1], SUPER)


def _dequantize_q6_k(b: torch.Tensor) -> torch.Tensor:
    """[..., 210] super-blocks -> [..., 256] floats: w = d sc (q - 32), a scale per 16 weights."""
    lead = b.shape[:-1]
    ql, qh = b[..., 0:128].reshape(*lead, 2, 2, 32), b[..., 128:192].reshape(*lead, 2, 32)
    sc = b[..., 192:208].contiguous().view(torch.int8).float().reshape(*lead, 2, 4, 2)
    d = _half(b[..., 208:210]).reshape(*lead, 1, 1, 1)
    lo, hi = ql[..., 0, :], ql[..., 1, :]  # bytes l and l + 32 of each half
    q = torch.stack([(lo & 0x0F) | ((qh & 3) << 4), (hi & 0x0F) | (((qh >> 2) & 3) << 4),
                     (lo >> 4) | (((qh >> 4) & 3) << 4), (hi >> 4) | (((qh >> 6) & 3) << 4)], dim=-2)  # fmt: skip
    q = q.float().reshape(*lead, 2, 4, 2, 16) - 32  # [half, group of 32, its two scales' 16 weights]
    return (d.unsqueeze(-1) * sc.unsqueeze(-1) * q).reshape(*lead, SUPER)


def dequantize(blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """The float32 weights [rows, k] of `blocks` (uint8 [rows, row bytes]), in torch alone."""
    rows = blocks.shape[0]
    if blocks.shape[-1] != row_bytes(qtype, k):
        raise ValueError(f"{blocks.shape[-1]} bytes a row do not hold {k} {NAMES[qtype]} weights")
    if qtype in K_QUANTS:
        b = blocks.reshape(rows, k // SUPER, BLOCK_BYTES[qtype])
        return (_dequantize_q4_k(b) if qtype == Q4_K else _dequantize_q6_k(b)).reshape(rows, k)
    b = blocks.reshape(rows, k // BLOCK, BLOCK_BYTES[qtype])
    d = b[..., 0:2].contiguous().view(torch.float16).float()
    if qtype == Q8_0:
        w = b[..., 2:].contiguous().view(torch.int8).float() * d
    else:
        nib = b[..., 4:] if qtype == Q4_1 else b[..., 2:]
        q = torch.cat([nib & 0x0F, nib >> 4], dim=-1).float()
        w = q * d + b[..., 2:4].contiguous().view(torch.float16).float() if qtype == Q4_1 else (q - 8) * d
    return w.reshape(rows, k)


def linear(ops: ModuleType, x: torch.Tensor, blocks: torch.Tensor, qtype: int, bias: torch.Tensor | None,
           int8: bool = False) -> torch.Tensor:  # fmt: skip
    """x [M, K] times the blocks' weight, by cbserve's kernel for the type."""
    if base_type(qtype) in K_QUANTS:
        return ops.kquant_linear(x, blocks, qtype, bias, int8)
    return ops.quant_linear(x, blocks, qtype, bias, int8)


def dequantize_rows(ops: ModuleType, blocks: torch.Tensor, qtype: int, k: int, rows: torch.Tensor | None,
                    like: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Rows of the blocks' weight (all when `rows` is None) in `like`'s dtype, by cbserve's kernel."""
    if base_type(qtype) in K_QUANTS:
        return ops.kquant_dequantize(blocks, qtype, k, rows, like)
    return ops.quant_dequantize(blocks, qtype, k, rows, like)


class QuantizedLinear(torch.nn.Module):
    """y = x W^T + b with W in GGUF blocks (uint8 [out_features, row bytes])."""

    def __init__(self, blocks: torch.Tensor, qtype: int, in_features: int, bias: torch.Tensor | None = None,
                 ops: ModuleType | None = None, out_order: torch.Tensor | None = None) -> None:  # fmt: skip
        super().__init__()
        width = row_bytes(base_type(qtype), in_features)
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != width:
            raise ValueError(f"{NAMES.get(base_type(qtype), qtype)} blocks for {in_features} inputs must be uint8 "
                             f"[rows, {width}], got {blocks.dtype} {list(blocks.shape)}")
        if out_order is not None and (out_order.dtype != torch.int64 or out_order.shape != (blocks.shape[0],)):
            raise ValueError(f"out_order must be int64 [{blocks.shape[0]}], got {out_order.dtype} {list(out_order.shape)}")
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)
        # output i is the blocks' row out_order[i] (the rows stay where the file has them: no copy)
        self.register_buffer("out_order", out_order, persistent=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.qtype, self.in_features, self.out_features, self.ops = qtype, in_features, blocks.shape[0], ops
        self.int8_activations = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        order = self.out_order
        if self.ops is not None and (x2.shape[0] <= DEQUANTIZE_ROWS or self.int8_activations):
            if order is None:
                y = linear(self.ops, x2, self.blocks, self.qtype, self.bias, self.int8_activations)
            else:  # the rows in the file's order, then moved (a gather of out_features values a row)
                y = linear(self.ops, x2, self.blocks, self.qtype, None, self.int8_activations).index_select(1, order)
                if self.bias is not None:
                    y = y + self.bias
        elif self.ops is not None:  # a prompt step: a float copy for this call (rows in order), torch's product
            w = dequantize_rows(self.ops, self.blocks, self.qtype, self.in_features, order, x2)
            y = torch.nn.functional.linear(x2, w, self.bias)
        else:
            y = torch.nn.functional.linear(x2, self.dequantized(x.dtype), self.bias)
        return y.view(*shape[:-1], self.out_features)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.qtype & REPACKED:  # only the kernels read that layout
            return dequantize_rows(self.ops, self.blocks, self.qtype, self.in_features, self.out_order,
                                   torch.empty(0, dtype=dtype))  # fmt: skip
        blocks = self.blocks if self.out_order is None else self.blocks.index_select(0, self.out_order)
        return dequantize(blocks, self.qtype, self.in_features).to(dtype)

    def extra_repr(self) -> str:
        repacked = ", repacked" if self.qtype & REPACKED else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, {NAMES[base_type(self.qtype)]}"
                f"{repacked}, bias={self.bias is not None}")


def use_int8_activations(model: torch.nn.Module) -> int:
    """Every `QuantizedLinear` of `model` switched to its int8 product; the count. On a build that has
    int8 tiles, each weight is repacked for them (a new tensor
    of the same size; an embedding on the same bytes, a tied LM head's, takes the repacked ones too,
    so the bytes stay held once). The model's placement (`cbserve_quantization`, GET /v1/models)
    says so."""
    count, repacked = 0, {}
    modules = list(model.modules())
    for m in modules:
        if isinstance(m, QuantizedLinear):
            m.int8_activations = True
            count += 1
            if m.qtype in REPACKABLE and m.ops is not None and m.ops.quant_repack_rows():
                key = m.blocks.data_ptr()  # the file's bytes, or a copy the loader made
                if key not in repacked:
                    repacked[key] = m.ops.quant_repack(m.blocks, m.qtype, m.in_features)
                    _unmap_file_pages(m.blocks)  # read once: the file's pages need not stay beside the copy
                m.blocks, m.qtype = repacked[key], m.qtype | REPACKED
    for m in modules:  # an embedding on bytes that were repacked
        if isinstance(m, QuantizedEmbedding) and m.qtype in REPACKABLE and m.blocks.data_ptr() in repacked:
            m.blocks, m.qtype = repacked[m.blocks.data_ptr()], m.qtype | REPACKED
    if count:
        info = dict(getattr(model, "cbserve_quantization", None) or {})
        model.cbserve_quantization = {**info, "activations": "int8", **({"repacked": len(repacked)} if repacked else {})}
    return count


def _unmap_file_pages(t: torch.Tensor) -> None:
    """Where t's bytes are a read-only mapping of a file (a GGUF weight in place), drop this process's
    hold on the pages wholly inside them (madvise MADV_DONTNEED): they stay in the page cache for other
    readers (another server, the next start), a page touched again is read back from the file, and the
    process's resident memory no longer counts them. Repacking reads each weight of the mapped file
    once; without this its pages would stay resident beside the repacked copy until the file is
    unmapped, and the process's peak memory would be twice the file's. Anything else (anonymous
    memory, where MADV_DONTNEED would zero the pages) is left alone."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if end <= start:
        return
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                low, high = (int(v, 16) for v in fields[0].split("-"))
                if low <= start and end <= high:
                    if len(fields) >= 6 and fields[5].startswith("/") and "w" not in fields[1]:
                        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # MADV_DONTNEED
                    return
    except OSError:  # no /proc (not Linux): nothing dropped
        return


class QuantizedEmbedding(torch.nn.Module):
    """A token embedding in GGUF blocks: the rows looked up are dequantized to `dtype`."""

    def __init__(self, blocks: torch.Tensor, qtype: int, embedding_dim: int, dtype: torch.dtype,
                 ops: ModuleType | None = None) -> None:  # fmt: skip
        super().__init__()
        row_bytes(base_type(qtype), embedding_dim)
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)
        self.qtype, self.embedding_dim, self.num_embeddings, self.dtype, self.ops = (
            qtype, embedding_dim, blocks.shape[0], dtype, ops)  # fmt: skip

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self.ops is not None:
            rows = dequantize_rows(self.ops, self.blocks, self.qtype, self.embedding_dim, flat,
                                   torch.empty(0, dtype=self.dtype))  # fmt: skip
        else:
            rows = dequantize(self.blocks[flat], self.qtype, self.embedding_dim).to(self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {NAMES[base_type(self.qtype)]}"


def quantized_bytes(model: torch.nn.Module) -> int:
    """Bytes of the quantized blocks a model holds (shared blocks counted once)."""
    seen = {m.blocks.data_ptr(): m.blocks.numel() for m in model.modules()
            if isinstance(m, (QuantizedLinear, QuantizedEmbedding))}  # fmt: skip
    return sum(seen.values())
