"""`quantization: int8`: any checkpoint's linear layers held as int8 with one scale per output row,
made at load time, multiplied by the GGUF kernels (engine/csrc/quant_cpu.cpp) on the CPU.

Each row of a weight W [out, in] gets a scale d = max|W[row]| / 127, rounded to float16, and its
weights q = round(W / d) clamped to [-127, 127]: per-channel symmetric int8, the scheme of
weight-only int8 in PyTorch's and llama.cpp's users' hands. The row is stored as GGUF Q8_0 blocks
(each block of 32: the float16 scale, then 32 int8), every block of a row carrying the row's one
scale, so the Q8_0 kernels run it unchanged: activations stay float (the product dequantizes each
block in registers) unless `int8_activations` is set on the modules (rows quantized to int8 blocks
of 32 and integer dot products, VNNI where the CPU has it). 8.5 bits a weight: a quarter of
float32's bytes, a little over half of bfloat16's.

Every `torch.nn.Linear` whose input width is a whole number of blocks is replaced, the LM head too
(a tied head gets its own int8 copy; the embedding stays float); `model.generate` and the engine
then run the same products.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from engine.backends.cpu_quant import BLOCK, Q8_0, QuantizedLinear

logger = logging.getLogger("cbserve.int8")


def quantize_rows(weight: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in / 32 * 34]: `weight` [out, in] as Q8_0 blocks with one float16 scale per row."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"int8 rows need a 2-D weight whose width is a multiple of {BLOCK}, got {list(weight.shape)}")
    w = weight.detach().float()
    rows, k = w.shape
    scale = (w.abs().amax(dim=1) / 127).to(torch.float16)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    q = torch.clamp(torch.round(w / safe[:, None]), -127, 127).to(torch.int8)
    blocks = torch.empty(rows, k // BLOCK, 2 + BLOCK, dtype=torch.uint8)
    blocks[..., :2] = scale.view(torch.uint8).view(rows, 1, 2)
    blocks[..., 2:] = q.view(rows, k // BLOCK, BLOCK).view(torch.uint8)
    return blocks.view(rows, -1)


def quantize_model(model: torch.nn.Module, ops: ModuleType | None) -> int:
    """Replace the model's linear layers by int8 ones (see the module docstring); the count replaced."""
    replaced, kept = 0, []
    for name, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear:
            continue
        if module.in_features % BLOCK or module.weight.device.type != "cpu":
            kept.append(name)
            continue
        bias = None if module.bias is None else module.bias.detach()
        model.set_submodule(name, QuantizedLinear(quantize_rows(module.weight), Q8_0, module.in_features, bias, ops))
        replaced += 1
    if kept:
        logger.info("cbserve: int8: %d linear layers kept in float (input width not a multiple of %d): %s",
                    len(kept), BLOCK, ", ".join(kept[:4]) + (" ..." if len(kept) > 4 else ""))  # fmt: skip
    return replaced
