"""Every request the rollout manager sends to a server, and what happens when one goes wrong.

Bounded: at most `max_inflight` requests at once (`slots`, oldest sample first). The manager's
admission check (staleness, stopping) runs before each request and again once its slot is granted.
A request whose server fails or stops making progress resumes on another server from the tokens
its sample holds (at most `max_request_retries` moves); with every server down it waits for one,
up to `request_timeout_s`. A 4xx (RequestRefused) goes to the caller: the request itself is wrong.
`abort(rids)` makes one call per server; an aborted request returns what it generated so far.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable

from rollout.client import Generation, RequestRefused, ServerClient, ServerError
from rollout.config import KvPolicy, RolloutConfig
from rollout.metrics import RolloutMetrics
from rollout.router import NoServerAvailable, Router
from rollout.slots import RequestSlots
from rollout.types import Sample, SampleStatus

log = logging.getLogger(__name__)


class RolloutStopped(Exception):
    """The manager is stopping: the sample stays partial, to be resumed after a restart."""


@dataclass
class InFlightRequest:
    sample: Sample
    client: ServerClient
    started: float
    budget: int
    version: int            # the trainer's version when it was sent: its tokens are no older than the
                            # servers' weights then (at most that much behind, while a push is landing)


class Requests:
    def __init__(self, cfg: RolloutConfig, router: Router, metrics: RolloutMetrics,
                 admit: Callable[[Sample], None], trainer_version: Callable[[], int]):
        self.cfg, self.router, self.metrics = cfg, router, metrics
        self.admit = admit                      # raises StaleSample or RolloutStopped
        self.trainer_version = trainer_version
        self.inflight: dict[str, InFlightRequest] = {}
        self.slots = RequestSlots(cfg.max_inflight)
        self._ids = itertools.count()
        self._rate: float | None = None         # tokens/s of one request, for the abort policy

    def reset(self) -> None:
        """Fresh slots for a (re)start: stop() cancelled every waiter of the old ones."""
        self.slots = RequestSlots(self.cfg.max_inflight)

    async def send(self, sample: Sample, params: dict,
                   sticky: ServerClient | None) -> tuple[Generation | None, ServerClient | None]:
        """One request continuing `sample`; (None, _) when its server failed: ask again."""
        async with self.slots.take(self.priority(sample)):
            self.admit(sample)                  # a new version may have landed while it waited
            try:
                client = self.router.pick(sticky)
            except NoServerAvailable:           # every server is down: wait for one, don't fail the sample
                await self.router.wait_for_server(self.cfg.request_timeout_s)
                return None, None
            rid, started, version = f"{sample.uid}-{next(self._ids)}", time.monotonic(), self.trainer_version()
            wall = time.time()
            self.inflight[rid] = InFlightRequest(sample, client, started, params["max_new_tokens"], version)
            sample.status = SampleStatus.RUNNING
            try:
                gen = await self.router.call(client, client.generate(sample.input_ids, params, rid, fallback_version=version,
                                                                     kv_policy=KvPolicy(self.cfg.kv_policy).value))
            except RequestRefused:
                raise
            except ServerError as e:
                return await self._failed(sample, client, e), client
            finally:
                del self.inflight[rid]
        gen.segment = [client.url, wall, time.time()]
        self._observe_rate(len(gen.output_ids), time.monotonic() - started)
        self.metrics.tokens_by_server[client.url] += len(gen.output_ids)
        return gen, client

    def priority(self, sample: Sample) -> tuple:
        """Oldest tokens first: a partial sample closest to the staleness bound gets the next slot."""
        v = sample.min_version
        return (self.trainer_version() if v is None else v,)

    async def _failed(self, sample: Sample, client: ServerClient, error: ServerError) -> None:
        # a dropped connection to a live server is no reason to shun it (a server that left the fleet
        # is asked nothing)
        if client in self.router.clients and client.url not in self.router.down and not await client.healthy():
            self.router.mark_down(client, str(error))
        sample.num_retries += 1
        self.metrics.retries += 1
        if sample.num_retries > self.cfg.max_request_retries:
            raise error
        log.warning("sample %s: %s; resuming from %d tokens elsewhere", sample.uid, error, len(sample.response_ids))
        await self.router.wait_for_server(self.cfg.request_timeout_s)
        sample.status = SampleStatus.PARTIAL
        return None

    async def abort(self, rids: list[str]) -> None:
        """One abort call per server for all of its requests among `rids`."""
        by_server: dict[str, tuple[ServerClient, list[str]]] = {}
        for rid in rids:
            r = self.inflight.get(rid)
            if r is not None:
                by_server.setdefault(r.client.url, (r.client, []))[1].append(rid)

        async def one(client: ServerClient, server_rids: list[str]) -> None:
            try:
                await client.abort(server_rids)
            except ServerError as e:
                log.warning("abort of %d requests on %s failed (they go on): %s", len(server_rids), client.url, e)
        await asyncio.gather(*(one(c, r) for c, r in by_server.values()))

    def tokens_left(self, rid: str) -> float:
        """Of a request in flight, by the observed rate of one request."""
        r = self.inflight.get(rid)
        if r is None:
            return 0.0
        return r.budget - (time.monotonic() - r.started) * (self._rate or 0.0)

    def _observe_rate(self, tokens: int, seconds: float) -> None:
        if seconds > 0 and tokens > 0:
            rate = tokens / seconds
            self._rate = rate if self._rate is None else 0.9 * self._rate + 0.1 * rate
