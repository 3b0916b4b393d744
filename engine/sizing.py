"""Start-up sizes of the cache and the step: blocks, token budget, request cap."""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from engine.config import ContinuousBatchingConfig
from engine.kv_cache import PagedKVCache

CPU_CACHE_CAP_BYTES = 1 << 30  # the CPU cache takes at most this unless num_blocks says otherwise
DEFAULT_MAX_BATCH_TOKENS = {"cpu": 1024, "cuda": 8192}
DEFAULT_MAX_REQUESTS = 256


@dataclass
class Sizes:
    num_blocks: int
    block_size: int
    max_batch_tokens: int
    max_requests: int
    bytes_per_block: int

    def summary(self) -> str:
        gib = self.num_blocks * self.bytes_per_block / (1 << 30)
        return (
            f"KV cache {self.num_blocks} blocks x {self.block_size} tokens = {self.num_blocks * self.block_size} "
            f"tokens ({gib:.2f} GiB); max_batch_tokens {self.max_batch_tokens}; max_requests {self.max_requests}"
        )


def plan_sizes(
    config: ContinuousBatchingConfig,
    model: torch.nn.Module,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Sizes:
    bpb = PagedKVCache.bytes_per_block(num_layers, config.block_size, num_kv_heads, head_dim, dtype)
    num_blocks = config.num_blocks
    if num_blocks is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = free * config.max_memory_percent
        else:
            budget = min(psutil.virtual_memory().available * config.max_memory_percent, CPU_CACHE_CAP_BYTES)
        num_blocks = max(1, int(budget // bpb))
    max_batch_tokens = config.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS.get(device.type, 2048)
    max_requests = config.max_requests_per_batch or DEFAULT_MAX_REQUESTS
    return Sizes(num_blocks, config.block_size, max_batch_tokens, max_requests, bpb)
