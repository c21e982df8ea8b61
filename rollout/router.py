"""Spreads requests over servers: least in flight first; a multi-turn session sticks to its server.

A server that fails a request is marked down and gets no new work until a health check passes.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from rollout.client import ServerClient

log = logging.getLogger(__name__)


class NoServerAvailable(RuntimeError):
    pass


class Router:
    def __init__(self, clients: list[ServerClient], recheck_s: float = 2.0):
        if not clients:
            raise ValueError("Router needs at least one server")
        self.clients = clients
        self.inflight = {c.url: 0 for c in clients}
        self.down: dict[str, float] = {}        # url -> when it was marked down
        self.recheck_s = recheck_s

    def pick(self, sticky: ServerClient | None = None) -> ServerClient:
        if sticky is not None and sticky.url not in self.down:
            return sticky
        up = [c for c in self.clients if c.url not in self.down]
        if not up:
            raise NoServerAvailable("every server is marked down: " + ", ".join(self.down))
        return min(up, key=lambda c: self.inflight[c.url])

    @contextlib.contextmanager
    def track(self, client: ServerClient):
        self.inflight[client.url] += 1
        try:
            yield
        finally:
            self.inflight[client.url] -= 1

    def mark_down(self, client: ServerClient, reason: str) -> None:
        if client.url not in self.down:
            log.warning("server %s marked down: %s", client.url, reason)
            self.down[client.url] = time.monotonic()

    async def recheck(self) -> None:
        """Bring back servers that answer /health again."""
        for url, since in list(self.down.items()):
            if time.monotonic() - since < self.recheck_s:
                continue
            client = next(c for c in self.clients if c.url == url)
            if await client.healthy():
                log.info("server %s is back", url)
                self.down.pop(url, None)
            else:
                self.down[url] = time.monotonic()

    async def wait_for_server(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.down) == len(self.clients):
            if time.monotonic() > deadline:
                raise NoServerAvailable(f"no server came back within {timeout_s}s: " + ", ".join(self.down))
            await asyncio.sleep(self.recheck_s / 2)
            await self.recheck()

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
