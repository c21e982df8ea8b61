"""Request slots: `max_inflight` of them, handed out lowest priority key first (FIFO among equals).

A plain semaphore serves waiters in arrival order; here a sample resuming after an abort, whose
oldest token is versions behind, goes before a fresh one, so it finishes before it ages past the
staleness bound. A waiter cancelled after its slot was granted passes the slot on.
"""
from __future__ import annotations

import asyncio
import contextlib
import heapq


class RequestSlots:
    def __init__(self, n: int):
        self.free = n
        self._waiters: list[tuple[tuple, int, asyncio.Future]] = []
        self._count = 0

    @contextlib.asynccontextmanager
    async def take(self, key: tuple):
        """`async with slots.take(key):` holds one slot for the block."""
        await self.acquire(key)
        try:
            yield
        finally:
            self.release()

    async def acquire(self, key: tuple) -> None:
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        self._count += 1
        heapq.heappush(self._waiters, (key, self._count, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()                  # granted and cancelled at once: pass the slot on
            raise

    def release(self) -> None:
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)            # the slot goes straight to the waiter
                return
        self.free += 1
