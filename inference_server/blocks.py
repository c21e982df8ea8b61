"""Which KV blocks each sequence holds: a free list and a reference count a block. Imports no torch.

A block holds `block_size` consecutive positions of one or more sequences' keys and values (several
when a prompt's blocks are shared by reference: a GRPO group's samples hold their prompt once). A
block returns to the free list when its last holder lets go.
"""
from __future__ import annotations


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV block pool needs blocks and positions: got {num_blocks} blocks of {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))       # popped from the end: low ids first
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def needed(self, held: list[int], tokens: int) -> int:
        """Blocks to add to `held` so that it covers positions [0, tokens)."""
        return max(0, self.blocks_for(tokens) - len(held))

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"{n} KV blocks asked, {len(self._free)} of {self.num_blocks} free")
        out = [self._free.pop() for _ in range(n)]
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
                self._free.append(b)

    def refs(self, block: int) -> int:
        return self._refs[block]
