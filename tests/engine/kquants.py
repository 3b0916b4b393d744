"""Q4_K and Q6_K encoders for the tests: gguf-py dequantizes K-quants but cannot make them.

Plain round-to-nearest with ggml's layouts (engine/csrc/kquant_cpu.cpp describes them), not
llama.cpp's error-minimising search: the tests need valid blocks of weights that resemble a model's,
and gguf-py's `dequantize` is the reference they are read back with.
"""

from __future__ import annotations

import numpy as np

SUPER = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def q4_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, k] (k a multiple of 256) -> uint8 [rows, k / 256 * 144]."""
    rows, k = w.shape
    sub = w.reshape(rows, k // SUPER, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / 15.0  # w = scale q + lo, q in 0..15
    mins = -lo
    d = np.maximum(scale.max(-1), 1e-8) / 63.0
    dmin = np.maximum(mins.max(-1), 1e-8) / 63.0
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / d16[..., None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.rint(mins / dmin16[..., None]), 0, 63).astype(np.uint8)
    step = (d16[..., None] * sc)[..., None]
    q = np.clip(np.rint((sub + (dmin16[..., None] * mn)[..., None]) / step), 0, 15).astype(np.uint8)
    packed = np.empty((rows, k // SUPER, 12), np.uint8)
    packed[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    packed[..., 4:8] = mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((mn[..., 4:8] & 0x0F) << 4)
    pairs = q.reshape(rows, k // SUPER, 4, 2, 32)  # sub-blocks 2i (low nibbles) and 2i + 1 (high)
    nibbles = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(rows, k // SUPER, 128)
    out = np.concatenate([_f16(d16), _f16(dmin16), packed, nibbles], axis=-1)
    return out.reshape(rows, -1)


def q6_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, k] (k a multiple of 256) -> uint8 [rows, k / 256 * 210]."""
    rows, k = w.shape
    sub = w.reshape(rows, k // SUPER, 16, 16).astype(np.float32)
    scale = np.abs(sub).max(-1) / 31.0  # w = scale (q - 32), q - 32 in -32..31
    d = np.maximum(np.abs(scale).max(-1), 1e-8) / 127.0
    d16 = d.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / d16[..., None]), 1, 127).astype(np.int8)
    step = (d16[..., None] * sc)[..., None]
    q = (np.clip(np.rint(sub / step), -32, 31) + 32).astype(np.uint8).reshape(rows, k // SUPER, 2, 4, 32)
    # per half of 128: group g of 32 is weights 32 g .. 32 g + 31
    low, high = q & 0x0F, q >> 4
    ql = np.concatenate([low[..., 0, :] | (low[..., 2, :] << 4), low[..., 1, :] | (low[..., 3, :] << 4)], axis=-1)
    qh = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)
    out = np.concatenate([ql.reshape(rows, k // SUPER, 128), qh.reshape(rows, k // SUPER, 64),
                          sc.view(np.uint8), _f16(d16)], axis=-1)  # fmt: skip
    return out.reshape(rows, -1)


def kquant_copy(src, dst) -> None:
    """A copy of the GGUF file `src` whose FFN down projections are K-quants: Q4_K in even layers,
    Q6_K in odd ones (re-encoded from their dequantized weights), everything else as it was."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    from engine.gguf_loader import open_reader

    reader = open_reader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":  # the writer adds these itself
            continue
        vtype = field.types[0]
        writer.add_key_value(name, field.contents(), vtype, field.types[-1] if vtype == GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        data, qtype = np.asarray(tensor.data), tensor.tensor_type
        if ".ffn_down." in tensor.name:
            w = dequantize(tensor.data, tensor.tensor_type).reshape(int(tensor.shape[1]), int(tensor.shape[0]))
            even = int(tensor.name.split(".")[1]) % 2 == 0
            data, qtype = (q4_k(w), GGMLQuantizationType.Q4_K) if even else (q6_k(w), GGMLQuantizationType.Q6_K)
        writer.add_tensor(tensor.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
