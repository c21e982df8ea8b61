"""The KV cache's second tier: prefix-cache blocks evicted from the pool, kept in host memory.

The paged pool (kv_cache.PagedKVCache) keeps a finished sequence's full blocks cached until it needs
the room; under many concurrent multi-turn episodes they are evicted while a tool runs, and the next
turn would prefill its whole context again. With a host tier (`--kv-host-gb`), an evicted cached
block's keys and values are copied out first, keyed as the prefix cache keys them (the chain hash of
its tokens and all before them, checked against the chain hash before it and its own tokens) and by
the weights that computed them (the pool's epoch); a newcomer whose tokens go on past the blocks the
pool holds finds the next ones here, and they are copied back into fresh pool blocks instead of
computed (blocks.BlockAllocator.match). A block's digest (xxh3 of its bytes) is taken when it is
written and checked when it is read: one that fails is dropped and its positions computed, never used.
New weights drop every entry made under others. Least recently used entries go first when the budget
is full.
"""
from __future__ import annotations

import time
from collections import OrderedDict

import torch
import xxhash


class HostTier:
    """`slots` blocks of keys and values in host memory ([slots, 2, layers, kv_heads, block_size,
    head_dim], allocated as they are first written), an LRU index over them, and counters."""

    def __init__(self, budget_bytes: int, kv, blocks):
        self.kv, self.blocks = kv, blocks
        layers, _, heads, size, dim = kv.k.shape
        self.block_bytes = 2 * layers * heads * size * dim * kv.k.element_size()
        self.slots = budget_bytes // self.block_bytes
        if self.slots < 1:
            raise ValueError(f"the host KV tier's budget ({budget_bytes / 2**30:.3g} GiB) holds no block of "
                             f"{self.block_bytes / 2**20:.1f} MiB")
        self.store = torch.empty((self.slots, 2, layers, heads, size, dim), dtype=kv.k.dtype)
        self._free = list(range(self.slots - 1, -1, -1))
        # chain hash -> (slot, chain hash before it, tokens, epoch, digest)
        self.entries: OrderedDict[int, tuple[int, int, tuple, int, int]] = OrderedDict()
        self.stats = {"saved_blocks": 0, "loaded_blocks": 0, "misses": 0, "corrupt_blocks": 0,
                      "loaded_tokens": 0, "load_bytes": 0, "load_seconds": 0.0, "dropped_blocks": 0}

    @property
    def size(self) -> int:
        return len(self.entries)

    def _digest(self, slot: int) -> int:
        return xxhash.xxh3_64_intdigest(self.store[slot].view(torch.uint8).numpy())

    def set_epoch(self, epoch: int | None) -> None:
        """New weights: entries made under others are of no use to a sequence of these."""
        for h in [h for h, e in self.entries.items() if e[3] != epoch]:
            self._drop(h)

    def _drop(self, h: int) -> None:
        self._free.append(self.entries.pop(h)[0])
        self.stats["dropped_blocks"] += 1

    def save(self, block: int, h: int, before: int, chunk: tuple) -> None:
        """Pool block `block` (cached as chain hash `h`) is about to be reused: keep a copy."""
        epoch = self.blocks.epoch
        if epoch is None:
            return
        if h in self.entries:
            self._drop(h)
        if not self._free:
            self._drop(next(iter(self.entries)))
        slot = self._free.pop()
        self.store[slot, 0] = self.kv.k[:, block]
        self.store[slot, 1] = self.kv.v[:, block]
        self.entries[h] = (slot, before, chunk, epoch, self._digest(slot))
        self.stats["saved_blocks"] += 1

    def has(self, h: int, before: int, chunk: tuple) -> bool:
        e = self.entries.get(h)
        if e is not None and e[1:4] == (before, chunk, self.blocks.epoch):
            return True
        self.stats["misses"] += 1
        return False

    def load(self, h: int, before: int, chunk: tuple, block: int) -> bool:
        """Copy entry `h` into pool block `block`; False (and the entry dropped) when its bytes no longer
        match the digest taken when it was written."""
        t = time.perf_counter()
        slot, *_, digest = self.entries[h]
        if self._digest(slot) != digest:
            self.stats["corrupt_blocks"] += 1
            self._drop(h)
            return False
        self.kv.k[:, block] = self.store[slot, 0]
        self.kv.v[:, block] = self.store[slot, 1]
        self.entries.move_to_end(h)
        self.stats["loaded_blocks"] += 1
        self.stats["loaded_tokens"] += len(chunk)
        self.stats["load_bytes"] += self.block_bytes
        self.stats["load_seconds"] += time.perf_counter() - t
        return True
