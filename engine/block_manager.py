"""The KV block ledger: which block belongs to whom, an O(1) LRU free list, and prefix caching.

A full block is keyed by a chained hash of (parent block's hash, its token ids). Freed blocks keep
their hash and stay findable until they are reused: the free list is an LRU, evicting one block at
a time (never the whole cache). Blocks are refcounted so requests sharing a prefix share blocks.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from engine.request import Request


def chain_hash(parent: int, token_ids: list[int]) -> int:
    data = parent.to_bytes(8, "little") + np.asarray(token_ids, dtype=np.int64).tobytes()
    return xxhash.xxh3_64_intdigest(data)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, allow_block_sharing: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.allow_block_sharing = allow_block_sharing
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # every block with refcount 0; the head is evicted first
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens found in the cache

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix caching ---------------------------------------------------------------------------
    def match_prefix(self, req: Request) -> int:
        """Attach cached blocks holding a prefix of a new request's tokens; returns tokens reused.

        The last token is never taken from the cache: its logits are needed, so it is recomputed.
        """
        assert not req.block_ids
        if not self.allow_block_sharing:
            return 0
        bs = self.block_size
        parent = 0
        for i in range((req.num_tokens - 1) // bs):
            tokens = req.token_ids[i * bs : (i + 1) * bs]
            h = chain_hash(parent, tokens)
            block = self.hash_to_block.get(h)
            if block is None or self.block_tokens[block] != tuple(tokens):
                break
            if self.ref_count[block] == 0:
                del self.free[block]
            self.ref_count[block] += 1
            req.block_ids.append(block)
            req.block_hashes.append(h)
            parent = h
        return len(req.block_ids) * bs

    def count_lookup(self, num_prompt_tokens: int, num_cached: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += min(num_cached, num_prompt_tokens)

    def register_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Make the request's full blocks among its first `num_tokens` tokens findable by others.

        Called when a step is scheduled, before it runs: a block computed in this step can be
        shared by a request admitted in the same step, because every layer writes the step's new
        K/V into the cache before any sequence attends.
        """
        if not self.allow_block_sharing:
            return
        bs = self.block_size
        for i in range(len(req.block_hashes), num_tokens // bs):
            parent = req.block_hashes[-1] if req.block_hashes else 0
            tokens = req.token_ids[i * bs : (i + 1) * bs]
            h = chain_hash(parent, tokens)
            block = req.block_ids[i]
            req.block_hashes.append(h)
            if h not in self.hash_to_block and self.block_hash[block] is None:
                self.hash_to_block[h] = block
                self.block_hash[block] = h
                self.block_tokens[block] = tuple(tokens)

    def forget_uncomputed(self, req: Request) -> None:
        """Unregister the blocks registered for a step that will not run for this request."""
        for i in range(req.num_computed // self.block_size, len(req.block_hashes)):
            if self.ref_count[req.block_ids[i]] == 1:
                self._forget(req.block_ids[i])
        del req.block_hashes[req.num_computed // self.block_size :]

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (after a failed step, whose blocks may hold garbage)."""
        for block in range(self.num_blocks):
            self._forget(block)

    # -- allocation -------------------------------------------------------------------------------
    def _shared_in_range(self, req: Request, num_tokens: int) -> list[int]:
        """Indices of the request's blocks that the tokens num_computed..num_tokens-1 would write
        into while another request still holds them (forked sequences share a partial block)."""
        first = req.num_computed // self.block_size
        last = min(len(req.block_ids), self.blocks_needed(num_tokens))
        return [i for i in range(first, last) if self.ref_count[req.block_ids[i]] > 1]

    def blocks_to_grow(self, req: Request, num_tokens: int) -> int:
        """Free blocks `grow(req, num_tokens)` takes: new ones, and copies of shared ones it writes into."""
        return max(0, self.blocks_needed(num_tokens) - len(req.block_ids)) + len(self._shared_in_range(req, num_tokens))

    def can_grow(self, req: Request, num_tokens: int) -> bool:
        return self.blocks_to_grow(req, num_tokens) <= len(self.free)

    def grow(self, req: Request, num_tokens: int) -> list[tuple[int, int]]:
        """Give the request enough blocks to hold `num_tokens` tokens (caller checked `can_grow`).

        Returns the (source, destination) block copies the cache must make first: a block the
        request is about to write into but shares with another request is copied (copy-on-write).
        """
        copies = []
        for i in self._shared_in_range(req, num_tokens):
            src = req.block_ids[i]
            dst = self._pop_free()
            self.ref_count[src] -= 1
            req.block_ids[i] = dst
            copies.append((src, dst))
        for _ in range(self.blocks_needed(num_tokens) - len(req.block_ids)):
            req.block_ids.append(self._pop_free())
        return copies

    def share(self, parent: Request, child: Request) -> None:
        """The child (a forked sequence) holds every block of the parent too."""
        child.block_ids = list(parent.block_ids)
        child.block_hashes = list(parent.block_hashes)
        for block in parent.block_ids:
            self.ref_count[block] += 1

    def _pop_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        self._forget(block)
        self.ref_count[block] = 1
        return block

    def release(self, req: Request) -> None:
        """Drop the request's references; blocks reaching zero go back to the free list."""
        for block in reversed(req.block_ids):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free[block] = None
                if self.block_hash[block] is None:  # nothing worth keeping: reuse it first
                    self.free.move_to_end(block, last=False)
        req.block_ids = []
        req.block_hashes = []

    def _forget(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
            self.block_hash[block] = None
            self.block_tokens[block] = None
