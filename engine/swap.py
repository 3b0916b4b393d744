"""Preemption by swapping: a preempted request's computed KV blocks wait in host memory.

The pool holds at most `cpu_offload_space` GiB. A victim whose blocks fit is copied out and later
copied back into fresh blocks when it is readmitted, instead of being recomputed; when the pool is
full the scheduler falls back to recompute. The copies use the cache's device-agnostic block copy.
"""

from __future__ import annotations

import torch

from engine.kv_cache import PagedKVCache
from engine.request import Request


class HostSwapPool:
    def __init__(self, cache: PagedKVCache, capacity_bytes: int, bytes_per_block: int) -> None:
        self.cache = cache
        self.capacity_blocks = capacity_bytes // bytes_per_block
        self.used_blocks = 0
        self._saved: dict[str, tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self.swap_out_total = 0  # blocks copied out
        self.swap_in_total = 0  # blocks copied back

    def holds(self, req: Request) -> bool:
        return req.request_id in self._saved

    def saved_tokens(self, req: Request) -> int:
        return self._saved[req.request_id][0]

    def swap_out(self, req: Request) -> bool:
        """Copy the request's computed blocks out; False (nothing copied) when they do not fit."""
        num_blocks = -(-req.num_computed // self.cache.block_size)
        if num_blocks == 0 or self.used_blocks + num_blocks > self.capacity_blocks:
            return False
        data = self.cache.copy_blocks_out(req.block_ids[:num_blocks])
        self._saved[req.request_id] = (req.num_computed, data)
        self.used_blocks += num_blocks
        self.swap_out_total += num_blocks
        return True

    def swap_in(self, req: Request) -> int:
        """Copy the saved blocks into the request's (already allocated) first blocks; returns tokens restored."""
        num_tokens, data = self._saved.pop(req.request_id)
        num_blocks = data[0][0].shape[0]
        self.cache.copy_blocks_in(req.block_ids[:num_blocks], data)
        self.used_blocks -= num_blocks
        self.swap_in_total += num_blocks
        return num_tokens

    def drop(self, req: Request) -> None:
        """Forget a request's saved blocks (it was cancelled while swapped out)."""
        saved = self._saved.pop(req.request_id, None)
        if saved is not None:
            self.used_blocks -= saved[1][0][0].shape[0]
