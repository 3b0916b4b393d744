"""The paged KV cache: preallocated key and value tensors, one pair per attention layer.

Layout per layer: [num_blocks, block_size, num_kv_heads, head_dim] (flash-attn's paged layout).
"""

from __future__ import annotations

import torch


def kv_geometry(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a transformers text config."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return config.num_hidden_layers, num_kv_heads, head_dim


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks within the cache, every layer: [(source, destination), ...]. The pairs
        reach a GPU through pinned memory without blocking (a step with copies waits for nothing)."""
        pairs = torch.tensor(copies, dtype=torch.long).view(-1, 2)
        device = self.k[0].device
        pairs = (pairs.pin_memory() if device.type == "cuda" else pairs).to(device, non_blocking=True)
        src, dst = pairs[:, 0], pairs[:, 1]
        for t in self.k + self.v:
            t.index_copy_(0, dst, t.index_select(0, src))

    def copy_blocks_out(self, blocks: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The contents of some blocks, per layer (for swapping to host memory)."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.k[0].device)
        return [(k.index_select(0, idx).cpu(), v.index_select(0, idx).cpu()) for k, v in zip(self.k, self.v)]

    def copy_blocks_in(self, blocks: list[int], data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        idx = torch.tensor(blocks, dtype=torch.long, device=self.k[0].device)
        for (k, v), (k_saved, v_saved) in zip(zip(self.k, self.v), data):
            k.index_copy_(0, idx, k_saved.to(k.device))
            v.index_copy_(0, idx, v_saved.to(v.device))
