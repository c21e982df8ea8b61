"""Spreads requests over servers: least in flight first; a multi-turn session sticks to its server.

Liveness is judged by progress, not by how fast one probe answers. `watch()` asks every server with
requests in flight what it has done so far (`/progress`: engine steps, CPU seconds off its HTTP thread) every
`probe_every_s`. A server that steps slowly (a trainer sharing its cores, a long prefill) still
moves its counters between probes and stays up, however long its steps take. One that does not
answer within `progress_timeout_s` (frozen, unreachable) or answers without moving its counters
for `progress_timeout_s` (hung) is marked down, and its requests in flight are cancelled: each
raises a retryable ServerError, so its sample resumes elsewhere from the tokens it holds. When no
other server is up, nothing is cancelled (there is nowhere to move to): the requests wait there.
A server that fails a request is marked down too. A server marked down gets no new work until it
makes progress again.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, TypeVar

from rollout.client import ServerClient, ServerError

log = logging.getLogger(__name__)
T = TypeVar("T")


class NoServerAvailable(RuntimeError):
    pass


class Router:
    def __init__(self, clients: list[ServerClient], recheck_s: float = 2.0, progress_timeout_s: float = 10.0,
                 probe_every_s: float = 1.0):
        if not clients:
            raise ValueError("Router needs at least one server")
        self.clients = clients
        self.inflight = {c.url: 0 for c in clients}
        self.down: dict[str, float] = {}        # url -> when it was marked down
        self.recheck_s, self.progress_timeout_s, self.probe_every_s = recheck_s, progress_timeout_s, probe_every_s
        self._calls: dict[str, set[asyncio.Task]] = {c.url: set() for c in clients}
        self._evicted: set[asyncio.Task] = set()
        self._evicted_why: dict[str, str] = {}
        self._seen: dict[str, tuple[float, float, float]] = {}    # url -> (steps, cpu_s, when they last moved)

    def watch_progress(self, timeout_s: float) -> None:
        """The manager's rollout.progress_timeout_s: how long a server with requests in flight may show
        no progress before it is marked down."""
        self.progress_timeout_s = timeout_s

    def pick(self, sticky: ServerClient | None = None) -> ServerClient:
        if sticky is not None and sticky in self.clients and sticky.url not in self.down:
            return sticky
        up = [c for c in self.clients if c.url not in self.down]
        if not up:
            raise NoServerAvailable("every server is marked down: " + ", ".join(self.down))
        return min(up, key=lambda c: self.inflight[c.url])

    async def call(self, client: ServerClient, request: Awaitable[T]) -> T:
        """Run one request on `client`, counted in its in-flight load. If the server is marked down
        for lack of progress meanwhile, the request is cancelled and raises a retryable ServerError."""
        task = asyncio.ensure_future(request)
        self._calls.setdefault(client.url, set()).add(task)
        self.inflight[client.url] = self.inflight.get(client.url, 0) + 1
        try:
            return await task
        except asyncio.CancelledError:
            if task in self._evicted:
                raise ServerError(client.url, self._evicted_why.get(client.url, "request moved")) from None
            raise
        finally:
            self.inflight[client.url] -= 1
            self._calls[client.url].discard(task)
            self._evicted.discard(task)

    def mark_down(self, client: ServerClient, reason: str) -> None:
        self._seen.pop(client.url, None)
        if client.url not in self.down:
            log.warning("server %s marked down: %s", client.url, reason)
            self.down[client.url] = time.monotonic()

    async def watch(self) -> None:
        """Until cancelled: probe busy servers for progress, bring back the ones that answer again."""
        while True:
            await asyncio.sleep(self.probe_every_s)
            busy = [c for c in self.clients if c.url not in self.down and self._calls.get(c.url)]
            await asyncio.gather(*(self._probe(c) for c in busy))
            if self.down:
                await self.recheck()

    async def _probe(self, client: ServerClient) -> None:
        stalled = await self._stalled(client)
        if stalled is None:
            return
        self.mark_down(client, f"{stalled} with {len(self._calls[client.url])} requests in flight")
        if self.any_up():             # else there is nowhere to move them: they wait where they are
            self._cancel_calls(client.url, f"{stalled}: request moved")

    async def _stalled(self, client: ServerClient) -> str | None:
        """Why the server counts as stalled, or None while it makes progress: an engine step, or
        CPU time off its HTTP thread (a step under way; answering probes is not in it)."""
        now = time.monotonic()
        seen = await client.progress(self.progress_timeout_s)
        if seen is None:
            return f"no answer within {self.progress_timeout_s}s"
        steps, cpu_s = seen
        last = self._seen.get(client.url)
        if last is None or steps != last[0] or cpu_s - last[1] > 1e-3:
            self._seen[client.url] = (steps, cpu_s, now)
            return None
        if now - last[2] >= self.progress_timeout_s:
            return f"no step and no CPU time for {now - last[2]:.0f}s (hung)"
        return None

    def _cancel_calls(self, url: str, why: str) -> None:
        self._evicted_why[url] = why
        for task in self._calls.get(url, ()):
            self._evicted.add(task)
            task.cancel()

    # ---- membership --------------------------------------------------------------------------------
    def add(self, client: ServerClient) -> None:
        """A server that joined the fleet: it takes requests from now on."""
        if any(c.url == client.url for c in self.clients):
            return
        self.clients.append(client)
        self.inflight.setdefault(client.url, 0)
        self.down.pop(client.url, None)

    async def remove(self, url: str) -> None:
        """A server that left the fleet: no new requests; the ones in flight there are cancelled and
        raise a retryable ServerError, so their samples resume on the others."""
        gone = [c for c in self.clients if c.url == url.rstrip("/")]
        if not gone:
            return
        self.clients = [c for c in self.clients if c not in gone]
        self.down.pop(gone[0].url, None)
        self._cancel_calls(gone[0].url, "the server left the fleet: request moved")
        await asyncio.sleep(0)                   # let the cancellations reach their requests
        for c in gone:
            await c.close()

    async def recheck(self) -> None:
        """Bring back servers that make progress again."""
        due = [c for c in self.clients if time.monotonic() - self.down.get(c.url, float("inf")) >= self.recheck_s]
        for client, ok in zip(due, await asyncio.gather(*(c.steps_again(self.progress_timeout_s) for c in due))):
            if ok:
                log.info("server %s is back", client.url)
                self.down.pop(client.url, None)
            else:
                self.down[client.url] = time.monotonic()

    def any_up(self) -> bool:
        return any(c.url not in self.down for c in self.clients)

    async def wait_for_server(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.any_up():
            if time.monotonic() > deadline:
                raise NoServerAvailable(f"no server came back within {timeout_s}s: " + ", ".join(self.down))
            await asyncio.sleep(self.recheck_s / 2)
            await self.recheck()

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
