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

Old KV, for requests that keep it (`continue`): with `keep_epochs` > 0 a new epoch does not forget the
cached blocks of the last `keep_epochs` epochs; they stay (keyed by their epoch too), evicted first as
the oldest idle ones (into the tier, under their epoch), and only `match(ids, oldest=...)` takes them,
for a sequence that asked for KV made under older weights; `epoch_of` says which weights made each.
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
        self.keep_epochs = 0                           # earlier epochs whose cached blocks stay, for old-KV requests
        self._cached: dict[int, int] = {}              # chain hash -> block (this epoch's)
        self._old: dict[tuple[int, int], int] = {}     # (epoch, chain hash) -> block, of the kept earlier epochs
        # block -> (chain hash, block before it or -1, tokens, chain hash before it or 0, epoch)
        self._meta: dict[int, tuple[int, int, tuple, int, int]] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()     # cached blocks nobody holds, oldest first
        self._ended: set[int] = set()                  # idle blocks of an ended episode: evicted first, not saved
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
        """The weights the keys and values are computed under now; a change forgets every cached block
        but those of the last `keep_epochs` epochs before it (kept for old-KV requests only)."""
        if epoch == self.epoch:
            return
        old, self.epoch = self.epoch, epoch
        if self.tier is not None:
            self.tier.set_epoch(epoch)
        if self.keep_epochs and old is not None:
            self._old.update(((old, h), b) for h, b in self._cached.items())
        self._cached.clear()
        for key, b in list(self._old.items()):
            if not self._kept(key[0]):
                del self._old[key]
                self._forget(b)
        for b in [b for b, m in self._meta.items() if m[4] != epoch and (m[4], m[0]) not in self._old]:
            self._forget(b)

    def _kept(self, epoch: int) -> bool:
        """Whether blocks made under `epoch` stay cached (for old-KV requests) under this epoch."""
        return self.epoch is not None and self.epoch - self.keep_epochs <= epoch < self.epoch

    def _forget(self, b: int) -> None:
        del self._meta[b]
        self._ended.discard(b)
        if b in self._idle:
            del self._idle[b]
            self._free.append(b)

    def epoch_of(self, block: int) -> int | None:
        """The epoch (weights version) a cached block's keys and values were made under; None when not cached."""
        m = self._meta.get(block)
        return None if m is None else m[4]

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
                self._cached[h], self._meta[blocks[i]] = blocks[i], (h, parent, chunk, before, self.epoch)
                have = blocks[i]
                if self.tier is not None:
                    self.tier.publish(have, h, before, chunk)
            elif have is None or self._meta[have][1:3] != (parent, chunk):
                return                                     # a hash shared by other tokens: stop here
            parent, before = have, h

    def match(self, ids: list[int], oldest: int | None = None) -> list[int]:
        """The cached blocks `ids` begins with (all but its last token at most: that one's logits
        are computed), taken by reference; past the last one the pool holds, those the tier holds,
        loaded into fresh blocks. With `oldest`, a block this epoch has not got may be one made under
        an earlier kept epoch, down to `oldest` (newest first): keys and values of older weights."""
        if self.epoch is None or not (self._cached or self._old or self.tier is not None and self.tier.size):
            return []
        epochs = [self.epoch] + ([e for e in range(self.epoch - 1, oldest - 1, -1) if self._kept(e)]
                                 if oldest is not None else [])
        out, parent, before = [], -1, 0
        for _, h, chunk in self._chain(ids, (len(ids) - 1) // self.block_size):
            b = next((b for e in epochs if (b := self._take(h, before, chunk, parent, e)) is not None), None)
            if b is None:
                break
            out.append(b)
            parent, before = b, h
        return out

    def _take(self, h: int, before: int, chunk: tuple, parent: int, epoch: int) -> int | None:
        """Block `h` of `epoch` by reference from the pool, else loaded from the tier; None if neither has it."""
        b = self._cached.get(h) if epoch == self.epoch else self._old.get((epoch, h))
        if b is None:
            return self._load(h, before, chunk, parent, epoch)
        if self._meta[b][2:4] != (chunk, before):
            return None                                    # a hash shared by other tokens
        if self._refs[b] == 0:
            del self._idle[b]
            self._ended.discard(b)
            self._refs[b] = 1
        else:
            self._refs[b] += 1
        return b

    def _load(self, h: int, before: int, chunk: tuple, parent: int, epoch: int) -> int | None:
        """The block of chain hash `h` made under `epoch` from the tier, into a fresh block cached as the
        pool's would be (held once, by the caller), or None when the tier has not got it (or it failed
        its digest)."""
        if self.tier is None or not self.tier.has(h, before, chunk, epoch) or self.num_free < 1:
            return None
        b = self.alloc(1)[0]
        if not self.tier.load(h, before, chunk, b, epoch):
            self.free([b])
            return None
        if epoch == self.epoch:
            self._cached[h] = b
        else:
            self._old[(epoch, h)] = b
        self._meta[b] = (h, parent, chunk, before, epoch)
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
        h, _, chunk, before, epoch = self._meta.pop(b)
        if epoch == self.epoch:
            del self._cached[h]
        else:
            del self._old[(epoch, h)]
        if b in self._ended:
            self._ended.discard(b)                       # an ended episode's: not worth the tier's room
        elif self.tier is not None:
            self.tier.save(b, h, before, chunk, epoch)   # its keys and values, before the block is reused
        return b

    def end(self, ids: list[int], keep: int) -> int:
        """An episode is over (its tokens `ids`; the first `keep` it shares with others, as a GRPO group's
        samples share their prompt): its own cached blocks nobody holds are the first evicted when room is
        needed, and not into the tier, where its entries are dropped too. Returns the pool blocks demoted."""
        n, bs = 0, self.block_size
        if self.epoch is None:
            return 0
        for i, h, chunk in self._chain(ids, len(ids) // bs):
            if (i + 1) * bs <= keep:
                continue
            b = self._cached.get(h)
            if b is not None and b in self._idle and self._meta[b][2] == chunk:
                self._idle.move_to_end(b, last=False)
                self._ended.add(b)
                n += 1
            if self.tier is not None:
                self.tier.forget(h, self.epoch)
        return n

    def flush(self) -> int:
        """Forget every cached block nobody holds (and the tier's entries); returns how many blocks."""
        idle = list(self._idle)
        for b in idle:
            h, _, _, _, epoch = self._meta[b]
            if epoch == self.epoch:
                del self._cached[h]
            else:
                del self._old[(epoch, h)]
            self._forget(b)
        if self.tier is not None:
            self.tier.clear()
        return len(idle)
