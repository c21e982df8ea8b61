"""Which KV blocks each sequence holds: a free list and a reference count a block. Imports no torch.

A block holds `block_size` consecutive positions of one or more sequences' keys and values (several
when a prompt's blocks are shared by reference: a GRPO group's samples hold their prompt once). A
block returns to the free list when its last holder lets go.

The prefix cache: a full block whose keys and values were computed under the weights of the
current `epoch` (the engine's weights version) is remembered by its tokens and those of every
block before it (`cache`). When its last holder lets go it is not freed but kept, least recently
used first out, until a block is needed. A newcomer whose tokens begin with cached blocks takes them
(`match`) and computes only the rest: a partial rollout resumed under the same weights, a
preempted sequence re-admitted, a multi-turn request, the later samples of a group. A new epoch
(new weights, or weights left torn: None) forgets every cached block.

A second tier (`tier`, kv_tier.py): a cached block evicted for room is first handed to it (its keys and
values copied out, keyed by its chain hash, the chain hash before it and its tokens); a newcomer whose
tokens go on past the cached blocks finds the next ones there, and they are loaded into fresh blocks
(and cached again) instead of computed.
"""
from __future__ import annotations

from collections import OrderedDict


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV block pool needs blocks and positions: got {num_blocks} blocks of {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))       # popped from the end: low ids first
        self._refs = [0] * num_blocks
        self.epoch: int | None = None                 # the prefix cache is on while this is not None
        self._cached: dict[int, int] = {}              # chain hash -> block
        self._meta: dict[int, tuple[int, int, tuple, int]] = {}  # block -> (chain hash, block before it or -1, tokens,
                                                                 #          chain hash before it or 0)
        self._idle: OrderedDict[int, None] = OrderedDict()     # cached blocks nobody holds, oldest first
        self.tier = None          # kv_tier.TierChain: where evicted cached blocks go, and come back from

    @property
    def num_free(self) -> int:
        """Blocks `alloc` can hand out: free ones, and cached ones nobody holds (evicted on the way)."""
        return len(self._free) + len(self._idle)

    @property
    def num_cached(self) -> int:
        return len(self._meta)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def needed(self, held: list[int], tokens: int) -> int:
        """Blocks to add to `held` so that it covers positions [0, tokens)."""
        return max(0, self.blocks_for(tokens) - len(held))

    def alloc(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocks(f"{n} KV blocks asked, {self.num_free} of {self.num_blocks} free")
        out = [self._free.pop() if self._free else self._evict() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def ref(self, blocks: list[int]) -> list[int]:
        """Another holder of `blocks` (shared by reference); returns them."""
        for b in blocks:
            if self._refs[b] < 1:
                raise ValueError(f"KV block {b} is free: it cannot be shared")
            self._refs[b] += 1
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] < 1:
                raise ValueError(f"KV block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._meta:
                    self._idle[b] = None
                else:
                    self._free.append(b)

    def refs(self, block: int) -> int:
        return self._refs[block]

    # ---- the prefix cache --------------------------------------------------------------------
    def set_epoch(self, epoch: int | None) -> None:
        """The weights the keys and values are computed under now; a change forgets every cached block."""
        if epoch == self.epoch:
            return
        self.epoch = epoch
        if self.tier is not None:
            self.tier.set_epoch(epoch)
        for b in self._meta:
            if b in self._idle:
                self._free.append(b)
        self._cached.clear()
        self._meta.clear()
        self._idle.clear()

    def _chain(self, ids: list[int], n: int):
        """(i, chain hash, tokens) of the first n full blocks of `ids`."""
        h, bs = 0, self.block_size
        for i in range(n):
            chunk = tuple(ids[i * bs:(i + 1) * bs])
            h = hash((h, chunk))
            yield i, h, chunk

    def cache(self, ids: list[int], blocks: list[int], valid: int) -> None:
        """Remember the full blocks among a sequence's first `valid` positions (tokens `ids`, held
        in `blocks`), computed under this epoch's weights."""
        if self.epoch is None:
            return
        parent, before = -1, 0
        for i, h, chunk in self._chain(ids, min(valid // self.block_size, len(blocks))):
            have = self._cached.get(h)
            if have is None and blocks[i] not in self._meta:
                self._cached[h], self._meta[blocks[i]] = blocks[i], (h, parent, chunk, before)
                have = blocks[i]
                if self.tier is not None:
                    self.tier.publish(have, h, before, chunk)
            elif have is None or self._meta[have][1:3] != (parent, chunk):
                return                                     # a hash shared by other tokens: stop here
            parent, before = have, h

    def match(self, ids: list[int]) -> list[int]:
        """The cached blocks `ids` begins with (all but its last token at most: that one's logits
        are computed), taken by reference; past the last one the pool holds, those the tier holds,
        loaded into fresh blocks."""
        if self.epoch is None or not (self._cached or self.tier is not None and self.tier.size):
            return []
        out, parent, before = [], -1, 0
        for _, h, chunk in self._chain(ids, (len(ids) - 1) // self.block_size):
            b = self._cached.get(h)
            if b is None:
                b = self._load(h, before, chunk, parent)
                if b is None:
                    break
            elif self._meta[b][1:3] != (parent, chunk):
                break
            elif self._refs[b] == 0:
                del self._idle[b]
                self._refs[b] = 1
            else:
                self._refs[b] += 1
            out.append(b)
            parent, before = b, h
        return out

    def _load(self, h: int, before: int, chunk: tuple, parent: int) -> int | None:
        """The block of chain hash `h` from the tier, into a fresh block cached as the pool's would be
        (held once, by the caller), or None when the tier has not got it (or it failed its digest)."""
        if self.tier is None or not self.tier.has(h, before, chunk) or self.num_free < 1:
            return None
        b = self.alloc(1)[0]
        if not self.tier.load(h, before, chunk, b):
            self.free([b])
            return None
        self._cached[h], self._meta[b] = b, (h, parent, chunk, before)
        return b

    def release(self, seq) -> None:
        """A sequence lets go of its blocks; the full ones among its computed positions (all but
        the last token's) stay cached if it computed them under this epoch."""
        if seq.blocks and seq.kv_epoch is not None and seq.kv_epoch == self.epoch:
            self.cache(seq.all_ids, seq.blocks, seq.num_tokens - 1)
        self.free(seq.blocks)
        seq.blocks, seq.cached = [], 0

    def _evict(self) -> int:
        b, _ = self._idle.popitem(last=False)
        h, _, chunk, before = self._meta.pop(b)
        del self._cached[h]
        if self.tier is not None:
            self.tier.save(b, h, before, chunk)        # its keys and values, before the block is reused
        return b
