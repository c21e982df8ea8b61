"""Decides which sequences run each step. Imports no torch.

Slots: `running[i]` owns KV slot `i`, always a dense prefix, so a decode step attends over slots
`[0, len(decode))` with no gather; newcomers take the slots after them. Removing a sequence moves the last one into its hole; the
caller applies the returned move `(src, dst)` to the KV cache.

Blocks (a paged KV cache: `blocks` set): a sequence runs only while it holds the blocks its tokens
fill. Each step first gives every running sequence the block its next token needs; when the pool
is short, the most recently admitted sequences are preempted (their blocks freed; they wait at the
head of the queue and re-prefill prompt + output when they run again, keeping what they generated)
until the rest fit. A newcomer is admitted while its blocks fit with one block of room a running
sequence left over, so that growth rarely has to preempt. The blocks its tokens begin with that the
prefix cache holds (blocks.py) it takes by reference, and computes only the rest; a sequence that
lets go of its blocks leaves its full ones cached (a preempted one finds them again when it returns).
"""
from __future__ import annotations

from collections import deque

from inference_server.blocks import BlockAllocator
from inference_server.sequence import Sequence, SeqStatus


class Scheduler:
    def __init__(self, max_running: int, max_prefill_tokens: int, context_length: int):
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.context_length = context_length
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.paused = False
        # CPU split steps (cpu_split): a lone newcomer whose prefill joins a big batch is held for up
        # to this many steps until a second slot frees, so that each of the two threads has a prefill
        # to run beside its decode rows; alone, its prefill makes the other thread wait (0: never hold)
        self.pair_newcomers = 0
        self.pair_min_running = 16
        self._held = 0
        self.blocks: BlockAllocator | None = None
        self.preemptions = 0
        self.cached_tokens = 0                  # prompt positions taken from the prefix cache

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return not self.paused and bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], list[Sequence]]:
        """(decode, prefill): everyone running decodes one token, and newcomers join the same step
        while slots and the prefill token budget allow, so a join never stalls the running batch."""
        if self.paused:
            return [], []
        if self.blocks is not None:
            self._grow()
        decode = list(self.running)
        prefill, budget = [], self.max_prefill_tokens
        if (self.pair_newcomers and self.waiting and len(self.running) + 1 == self.max_running
                and len(self.running) >= self.pair_min_running and self._held < self.pair_newcomers):
            self._held += 1                     # one free slot: wait a step or two for a second
            return decode, prefill
        self._held = 0
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if prefill and seq.num_tokens > budget:
                break
            if self.blocks is not None and not self._take_blocks(seq):
                break
            self.waiting.popleft()
            budget -= seq.num_tokens
            seq.slot, seq.status = len(self.running), SeqStatus.RUNNING
            self.running.append(seq)
            prefill.append(seq)
        return decode, prefill

    def _grow(self) -> None:
        """Every running sequence gets the blocks its next token needs, preempting from the back."""
        need = [self.blocks.needed(s.blocks, s.num_tokens) for s in self.running]
        while sum(need) > self.blocks.num_free and len(self.running) > 1:
            need.pop()
            self._preempt(self.running.pop())
        for seq, n in zip(self.running, need):
            if n:
                seq.blocks += self.blocks.alloc(n)

    def _take_blocks(self, seq: Sequence) -> bool:
        """Blocks for all of `seq`'s tokens, the cached ones its tokens begin with by reference
        (`seq.cached` positions it need not compute), with one block of room a running sequence left."""
        epoch = self.blocks.epoch
        oldest = epoch - self.blocks.keep_epochs if seq.keep_old_kv and epoch is not None else None
        cached = self.blocks.match(seq.all_ids, oldest)
        n = self.blocks.blocks_for(seq.num_tokens) - len(cached)
        if n + len(self.running) > self.blocks.num_free:
            self.blocks.free(cached)
            return False
        seq.blocks = cached + self.blocks.alloc(n)
        seq.cached = seq.cached_tokens = len(cached) * self.blocks.block_size
        self.cached_tokens += seq.cached
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        seq.blocks, seq.slot, seq.status = [], None, SeqStatus.WAITING
        seq.num_retractions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def remove(self, seq: Sequence) -> tuple[int, int] | None:
        """Take `seq` out of the queues. Returns the KV slot move `(src, dst)` this causes, if any."""
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
            return None
        if seq.slot is None:
            return None
        hole, last = seq.slot, self.running.pop()
        seq.slot = None
        if last is seq:
            return None
        self.running[hole], last.slot = last, hole
        return len(self.running), hole

    def reorder(self, order: list[int]) -> None:
        """Running sequence i becomes the one at order[i] (the caller permutes the KV cache alike)."""
        self.running = [self.running[j] for j in order]
        for slot, seq in enumerate(self.running):
            seq.slot = slot

    def find(self, rid: str) -> list[Sequence]:
        return [s for s in (*self.running, *self.waiting) if s.matches(rid)]

    def all(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    def retract_all(self) -> None:
        """Give back every KV slot; the sequences re-prefill prompt + output when they resume."""
        for seq in reversed(self.running):
            seq.slot, seq.status = None, SeqStatus.WAITING
            seq.num_retractions += 1
            self.waiting.appendleft(seq)
        self.running.clear()
