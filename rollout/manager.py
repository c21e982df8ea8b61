"""The rollout manager: keeps the servers busy with GRPO groups and hands out ready batches.

Bounded: at most `max_inflight` requests run (the `request_slots` semaphore); at most
`groups_in_progress` groups are running or waiting to be consumed (oversampling); and, as in AReaL,
no group starts that could not be consumed within `max_staleness` versions. Staleness is checked
again per trajectory before each request (admission) and when a batch is handed out (consumption).
A new weight version aborts the in-flight requests furthest from finishing (policy); an aborted
sample keeps its tokens, logprobs and versions and resumes at once from prompt + partial response,
under the new weights. A request whose server fails, or stops making progress (the router's
watch), moves to another server, from the tokens received so far. A group whose requests still
fail runs its prompt again (`max_group_retries`); `max_failed_groups` failed groups in a row stop
the manager with the error instead of burning through the data. `stop()` aborts everything in
flight and keeps it as partial samples, waiting at most `progress_timeout_s` for a hung server;
with `state_dict()` they survive a restart, together with the data position.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

from rollout.agent import RolloutFn, single_turn
from rollout.client import ServerClient, ServerError
from rollout.config import RolloutConfig
from rollout.data import PromptSource
from rollout.filters import GroupFilter, all_equal
from rollout.rewards import RewardFn
from rollout.router import NoServerAvailable, Router
from rollout.types import Group, Sample, SampleStatus

log = logging.getLogger(__name__)


class StaleSample(Exception):
    """A trajectory would exceed max_staleness: dropped or regenerated, by config."""


class Stopped(Exception):
    """The manager is stopping: the sample stays partial, to be resumed after a restart."""


@dataclass
class _Request:
    sample: Sample
    client: ServerClient
    started: float
    budget: int
    version: int            # the trainer's version when it was sent: its tokens are no older than the
                            # servers' weights then (at most that much behind, while a push is landing)


@dataclass
class RolloutMetrics:
    """Running totals; `batch_metrics` reports per-batch differences and gauges."""
    samples_finished: int = 0
    tokens_generated: int = 0
    tokens_aborted: int = 0        # tokens in requests cut short by an abort (kept: they resume)
    tokens_resumed: int = 0        # response tokens carried into a resumed request
    tokens_wasted: int = 0         # generated tokens thrown away (filtered, stale, failed groups)
    retries: int = 0
    drops: collections.Counter = field(default_factory=collections.Counter)
    stale_dropped: int = 0
    kept_past_patience: int = 0    # groups the filter rejected but kept (filter_patience)
    groups_failed: int = 0         # groups whose requests or reward failed (each retried, or dropped)
    last_error: str = ""           # what the last failed group failed with
    requests_doomed: int = 0       # in-flight requests stopped early: their group already broke the bound

    def snapshot(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "drops"}
        d["drops"] = dict(self.drops)
        return d


class _Slots:
    """`max_inflight` request slots, handed out lowest priority key first (FIFO among equals).

    A plain semaphore would serve waiters in arrival order; here a sample resuming after an abort,
    whose oldest token is versions behind, goes before a fresh one, so it finishes before it ages
    past the staleness bound."""

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


class RolloutContext:
    """What a rollout function uses to talk to the servers for one sample."""

    def __init__(self, manager: "RolloutManager", sample: Sample):
        self.manager, self.sample = manager, sample
        self.server: ServerClient | None = None      # sticky: a session stays on one server
        self.tokenizer = manager.tokenizer
        self._requests = 0

    async def generate(self, sample: Sample | None = None, **sampling) -> str:
        """Continue `sample` from its current tokens; returns the text generated by this call."""
        m, sample = self.manager, sample or self.sample
        params = {**m.cfg.sampling_params(), **sampling}
        budget, made, resuming = params["max_new_tokens"], 0, False
        while True:
            m.admit(sample)
            if resuming:
                m.metrics.tokens_resumed += len(sample.response_ids)
            if made >= budget:
                sample.status = SampleStatus.TRUNCATED
                break
            gen, client = await self._request(sample, {**params, "max_new_tokens": budget - made})
            if gen is None:
                continue                               # the server failed: retried elsewhere
            sample.append_generated(gen.output_ids, gen.logprobs, gen.versions)
            made += len(gen.output_ids)
            m.metrics.tokens_generated += len(gen.output_ids)
            self.server = client
            if gen.finish_type != "abort":
                sample.status = SampleStatus.COMPLETED if gen.finish_type == "stop" else SampleStatus.TRUNCATED
                break
            sample.status, sample.num_aborts = SampleStatus.PARTIAL, sample.num_aborts + 1
            m.metrics.tokens_aborted += len(gen.output_ids)
            if m.stopping:
                raise Stopped()
            resuming = True
        return self.tokenizer.decode(sample.response_ids[len(sample.response_ids) - made:], skip_special_tokens=True)

    async def _request(self, sample: Sample, params: dict):
        m = self.manager
        async with m.request_slots.take(m.slot_priority(sample)):
            m.admit(sample)                 # a new version may have landed while it waited
            try:
                client = m.router.pick(self.server)
            except NoServerAvailable:       # every server is down: wait for one, don't fail the sample
                await m.router.wait_for_server(m.cfg.request_timeout_s)
                return None, None
            self._requests += 1
            rid, started = f"{sample.uid}-{self._requests}", time.monotonic()
            m.inflight[rid] = _Request(sample, client, started, params["max_new_tokens"], m.trainer_version)
            sample.status = SampleStatus.RUNNING
            try:
                gen = await m.router.call(client, client.generate(sample.input_ids, params, rid,
                                                                  fallback_version=m.trainer_version))
            except ServerError as e:
                if not e.retryable:
                    raise
                return await self._failed(sample, client, e), client
            finally:
                del m.inflight[rid]
        m.observe_rate(len(gen.output_ids), time.monotonic() - started)
        return gen, client

    async def _failed(self, sample: Sample, client: ServerClient, error: ServerError):
        m = self.manager
        # a dropped connection to a live server is no reason to shun it
        if client.url not in m.router.down and not await client.healthy():
            m.router.mark_down(client, str(error))
        sample.num_retries += 1
        m.metrics.retries += 1
        self.server = None
        if sample.num_retries > m.cfg.max_request_retries:
            raise error
        log.warning("sample %s: %s; resuming from %d tokens elsewhere", sample.uid, error, len(sample.response_ids))
        await m.router.wait_for_server(m.cfg.request_timeout_s)
        sample.status = SampleStatus.PARTIAL
        return None


class RolloutManager:
    def __init__(self, cfg: RolloutConfig, router: Router, data: PromptSource, tokenizer, reward_fn: RewardFn,
                 rollout_fn: RolloutFn = single_turn, group_filter: GroupFilter = all_equal,
                 on_drop: Callable[[Group, str], None] | None = None):
        self.cfg = cfg.validate()
        self.on_drop = on_drop                       # called with every group dropped, and why
        self.router, self.data, self.tokenizer = router, data, tokenizer
        router.progress_timeout_s = cfg.progress_timeout_s
        self.reward_fn, self.rollout_fn, self.group_filter = reward_fn, rollout_fn, group_filter
        self.trainer_version = 0
        self.consumed_groups = 0
        self.metrics = RolloutMetrics()
        self.inflight: dict[str, _Request] = {}
        self.running: dict[str, Group] = {}
        self.ready: collections.deque[Group] = collections.deque()
        self.resume: collections.deque[Group] = collections.deque()
        self.tasks: set[asyncio.Task] = set()
        self.stopping = False
        self.fatal: Exception | None = None          # an error every request would hit (bad config)
        self._rate: float | None = None              # tokens/s of one request, for the abort policy
        self._filtered = 0                           # filter drops since the last batch went out
        self._producer: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._failed_streak = 0                      # failed groups since the last one that succeeded
        self._last_batch = (time.monotonic(), 0, 0)  # time, samples finished, tokens generated

    # ---- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        self.stopping, self.fatal = False, None
        self._base = (self.trainer_version, self.consumed_groups)
        self.request_slots = _Slots(self.cfg.max_inflight)
        self._wake_producer, self._wake_consumer = asyncio.Event(), asyncio.Event()
        self._producer = asyncio.create_task(self._produce(), name="rollout-producer")
        self._watcher = asyncio.create_task(self.router.watch(), name="router-watch")

    async def stop(self) -> None:
        """Abort everything in flight; unfinished groups stay as partial groups (see state_dict).
        A server that does not give its requests back within `progress_timeout_s` is not waited
        for: those requests are cancelled and their samples keep the tokens they had."""
        self.stopping = True
        self._notify()
        aborting = asyncio.ensure_future(self._abort(list(self.inflight)))
        await asyncio.wait({aborting, *self.tasks}, timeout=self.cfg.progress_timeout_s)
        leftover = [t for t in (aborting, *self.tasks, self._producer, self._watcher) if t is not None and not t.done()]
        for t in leftover:
            t.cancel()
        await asyncio.gather(*leftover, return_exceptions=True)
        for group in self.running.values():
            for s in group.samples:
                if s.status is SampleStatus.RUNNING:     # its request was cancelled above
                    s.status = SampleStatus.PARTIAL if s.response_ids else SampleStatus.PENDING
        self.resume.extendleft(reversed(list(self.running.values())))
        self.running.clear()

    # ---- the producer ----------------------------------------------------------------------------
    async def _produce(self) -> None:
        while not self.stopping:
            if self._may_start():
                group = self.resume.popleft() if self.resume else self._new_group()
                self.running[group.group_id] = group
                task = asyncio.create_task(self._run_group(group), name=f"group-{group.group_id}")
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
                continue
            self._wake_producer.clear()
            try:
                await asyncio.wait_for(self._wake_producer.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass

    def _may_start(self) -> bool:
        if self.fatal is not None:
            return False
        if len(self.router.down) == len(self.router.clients):
            return False                    # no server: starting groups would only fail them
        in_progress = len(self.running) + len(self.ready)
        if in_progress >= self.cfg.groups_in_progress:
            return False
        # AReaL's bound: a group started now is consumed before the trainer passes version
        # trainer_version + max_staleness, given one batch per version (counted from start()).
        base_version, base_consumed = self._base
        capacity = (self.trainer_version - base_version + self.cfg.max_staleness + 1) * self.cfg.batch_size
        return self.consumed_groups - base_consumed + in_progress < capacity

    def _new_group(self) -> Group:
        item = self.data.next()
        if self.cfg.use_chat_template:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": item.prompt}],
                                                     add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            ids = self.tokenizer(item.prompt, add_special_tokens=False).input_ids
        gid = f"g{item.index}"
        samples = [Sample(gid, i, list(ids), item.prompt, item.label, metadata=dict(item.metadata))
                   for i in range(self.cfg.group_size)]
        return Group(gid, samples, item.index)

    async def _run_group(self, group: Group) -> None:
        try:
            results = await asyncio.gather(*(self._run_sample(s) for s in group.samples if not s.status.finished),
                                           return_exceptions=True)
            if any(isinstance(r, Stopped) for r in results) or self.stopping:
                return                                  # stays in `running`; stop() keeps it for resume
            stale = [r for r in results if isinstance(r, StaleSample)]
            reason = "stale" if stale else self._verdict(group)
            if reason not in (None, "stale", "failed"):
                # Like verl's max_num_gen_batches: a converged model makes most groups all-equal;
                # past the patience, keep them (zero advantage) rather than starve the trainer.
                patience = self.cfg.filter_patience
                if patience and self._filtered >= patience:
                    self.metrics.kept_past_patience += 1
                    reason = None
                else:
                    self._filtered += 1
            self.running.pop(group.group_id, None)
            if reason is None:
                self._failed_streak = 0
                self.ready.append(group)
            elif reason == "failed":
                self._group_failed(group)
            else:
                self._drop(group, reason)
        finally:
            self._notify()

    def _group_failed(self, group: Group) -> None:
        """Its prompt runs again, up to max_group_retries times; past max_failed_groups failures in a
        row the manager stops with the error, keeping the group for a resume."""
        error = next(s.error for s in group.samples if s.status is SampleStatus.FAILED)
        self.metrics.groups_failed += 1
        self.metrics.last_error = error
        self._failed_streak += 1
        log.warning("group %s failed (%d in a row): %s", group.group_id, self._failed_streak, error)
        if self._failed_streak >= self.cfg.max_failed_groups and self.fatal is None:
            self.fatal = RuntimeError(f"{self._failed_streak} groups in a row failed and none succeeded "
                                      f"(rollout.max_failed_groups); the last failed with: {error}")
            log.error("rollout stopped: %s", self.fatal)
        if group.retries >= self.cfg.max_group_retries and self.fatal is None:
            self._drop(group, "failed")
            return
        group.retries += 1
        self.metrics.tokens_wasted += sum(s.num_generated for s in group.samples)
        for s in group.samples:
            s.reset()
            s.num_retries = 0
        self.resume.append(group)

    async def _run_sample(self, sample: Sample) -> None:
        try:
            await self.rollout_fn(sample, RolloutContext(self, sample))
        except (Stopped, StaleSample):
            raise
        except ServerError as e:
            if not e.retryable and "sampling_params" in str(e):
                # the server refuses the rollout config itself (e.g. max_new_tokens past its context):
                # every request would fail the same way, so stop and tell the trainer; the sample
                # keeps what it had and its prompt is not used up
                if self.fatal is None:
                    self.fatal = e
                    log.error("rollout stopped: %s", e)
                sample.status = SampleStatus.PARTIAL if sample.response_ids else SampleStatus.PENDING
                self._notify()
                raise Stopped() from e
            sample.status, sample.error = SampleStatus.FAILED, str(e)
            return
        except (NoServerAvailable, ValueError) as e:
            sample.status, sample.error = SampleStatus.FAILED, str(e)
            return
        sample.response_text = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        try:
            sample.reward = float(await self.reward_fn(sample))
        except Exception as e:  # a user's reward function: record the error on the sample, keep running
            log.warning("reward function failed on sample %s: %r", sample.uid, e)
            sample.status, sample.error = SampleStatus.FAILED, f"reward function raised {e!r}"
        self.metrics.samples_finished += 1

    def _verdict(self, group: Group) -> str | None:
        if any(s.status is SampleStatus.FAILED for s in group.samples):
            return "failed"
        return self.group_filter(group)

    def _drop(self, group: Group, reason: str) -> None:
        if self.on_drop is not None:
            self.on_drop(group, reason)
        self.metrics.drops[reason] += 1
        self.metrics.tokens_wasted += sum(s.num_generated for s in group.samples)
        if reason == "stale" and self.cfg.stale_policy == "regenerate":
            for s in group.samples:
                s.reset()
            self.resume.append(group)

    def admit(self, sample: Sample) -> None:
        """Admission check before every request of a trajectory. The group is consumed whole, so a
        sample whose sibling already broke the bound stops too: its tokens could never be trained."""
        if self.stopping:
            raise Stopped()
        group = self.running.get(sample.group_id)
        staleness = group.staleness(self.trainer_version) if group is not None else sample.staleness(self.trainer_version)
        if staleness > self.cfg.max_staleness:
            self.metrics.stale_dropped += 1
            raise StaleSample(f"sample {sample.uid} (group {sample.group_id}): tokens from version "
                              f"{self.trainer_version - staleness}, trainer at {self.trainer_version}, "
                              f"bound {self.cfg.max_staleness}")

    def slot_priority(self, sample: Sample) -> tuple:
        """Oldest tokens first: a partial sample closest to the staleness bound gets the next slot."""
        v = sample.min_version
        return (self.trainer_version if v is None else v,)

    def _doomed_requests(self) -> list[str]:
        """In-flight requests whose group can no longer be consumed within the bound: a token of the
        group is already too old, or a request has been running since a version that now is (it
        has made tokens under it). A false alarm costs one resume: the abort returns the tokens
        with their versions, and admission decides on those."""
        oldest: dict[str, int] = {}
        for r in self.inflight.values():
            gid = r.sample.group_id
            oldest[gid] = min(oldest.get(gid, r.version), r.version)
        bound, tv = self.cfg.max_staleness, self.trainer_version
        doomed_groups = set()
        for gid, v in oldest.items():
            group = self.running.get(gid)
            if tv - v > bound or (group is not None and group.staleness(tv) > bound):
                doomed_groups.add(gid)
        return [rid for rid, r in self.inflight.items() if r.sample.group_id in doomed_groups]

    # ---- the trainer's side ----------------------------------------------------------------------
    async def next_batch(self) -> tuple[list[Group], dict]:
        """Wait for `batch_size` groups that passed the filter and the staleness bound."""
        t0 = time.monotonic()
        while True:
            self._drop_stale_ready()
            if len(self.ready) >= self.cfg.batch_size:
                break
            if self.fatal is not None:
                raise RuntimeError(f"the rollout manager stopped: {self.fatal}") from self.fatal
            if self.stopping:
                raise RuntimeError("the rollout manager is stopped")
            self._wake_consumer.clear()
            await self._wake_consumer.wait()
        groups = [self.ready.popleft() for _ in range(self.cfg.batch_size)]
        self.consumed_groups += len(groups)
        self._filtered = 0
        self._notify()
        return groups, self.batch_metrics(groups, time.monotonic() - t0)

    def _drop_stale_ready(self) -> None:
        fresh = collections.deque()
        for g in self.ready:
            if g.staleness(self.trainer_version) > self.cfg.max_staleness:
                self.metrics.stale_dropped += len(g.samples)
                self._drop(g, "stale")
            else:
                fresh.append(g)
        self.ready = fresh

    async def on_weights_updated(self, version: int, wait: bool = False) -> None:
        """The trainer published `version`: apply the in-flight policy; aborted samples resume on it.
        The aborts go out in the background unless `wait`: the trainer need not wait for them."""
        self.trainer_version = version
        # Requests of groups already past the bound stop now, whatever the policy: every further
        # token of theirs would be thrown away (they end as stale drops, or restart if regenerating).
        doomed = self._doomed_requests()
        skip = set(doomed)
        rids = [rid for rid in self.inflight if rid not in skip]
        if self.cfg.update_policy == "abort_furthest":
            # Only while rollout is a batch ahead of the trainer: the batch it takes next is ready,
            # and so is the one after. Short of that the trainer will wait on these very requests,
            # and an abort would add their re-prefill to its wait; a batch ahead, rollout has time
            # to spare, and it goes to redoing the longest requests' remaining tokens under the new
            # weights.
            if self._rollout_ahead():
                rids.sort(key=self._tokens_left, reverse=True)
                rids = rids[:math.ceil(len(rids) * self.cfg.abort_fraction)]
            else:
                rids = []
        elif self.cfg.update_policy == "continue":
            rids = []
        rids += doomed
        self.metrics.requests_doomed += len(doomed)
        task = asyncio.create_task(self._abort(rids), name=f"abort-for-v{version}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        if wait:
            await task
        self._notify()

    def _rollout_ahead(self) -> bool:
        """Ready groups, within the bound at the current version, for the next two batches."""
        bound, tv = self.cfg.max_staleness, self.trainer_version
        return sum(g.staleness(tv) <= bound for g in self.ready) >= 2 * self.cfg.batch_size

    def _tokens_left(self, rid: str) -> float:
        r = self.inflight.get(rid)
        if r is None:
            return 0.0
        done = (time.monotonic() - r.started) * (self._rate or 0.0)
        return r.budget - done

    def observe_rate(self, tokens: int, seconds: float) -> None:
        if seconds > 0 and tokens > 0:
            rate = tokens / seconds
            self._rate = rate if self._rate is None else 0.9 * self._rate + 0.1 * rate

    async def _abort(self, rids: list[str]) -> None:
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
                log.info("abort of %d requests on %s failed: %s", len(server_rids), client.url, e)
        await asyncio.gather(*(one(c, r) for c, r in by_server.values()))

    def _notify(self) -> None:
        self._wake_producer.set()
        self._wake_consumer.set()

    # ---- metrics and state -----------------------------------------------------------------------
    def batch_metrics(self, groups: list[Group], wait_s: float) -> dict:
        now = time.monotonic()
        t_prev, samples_prev, tokens_prev = self._last_batch
        m = self.metrics
        dt = max(now - t_prev, 1e-9)
        self._last_batch = (now, m.samples_finished, m.tokens_generated)
        samples = [s for g in groups for s in g.samples]
        staleness = collections.Counter(s.staleness(self.trainer_version) for s in samples)
        return {
            **m.snapshot(),
            "wait_s": wait_s,
            "samples_per_s": (m.samples_finished - samples_prev) / dt,
            "tokens_per_s": (m.tokens_generated - tokens_prev) / dt,
            "inflight": len(self.inflight),
            "groups_running": len(self.running),
            "groups_ready": len(self.ready),
            "staleness_hist": dict(sorted(staleness.items())),
            "max_staleness": max(staleness),
            "reward_mean": sum(s.reward for s in samples) / len(samples),
            "response_len_mean": sum(len(s.response_ids) for s in samples) / len(samples),
            "trainer_version": self.trainer_version,
        }

    def state_dict(self) -> dict:
        """Call after stop(): every unconsumed group, partial ones included, and the data position."""
        groups = [*self.ready, *self.resume, *self.running.values()]
        return {"trainer_version": self.trainer_version, "consumed_groups": self.consumed_groups,
                "data": self.data.state_dict(), "metrics": self.metrics.snapshot(),
                "groups": [{"group_id": g.group_id, "data_index": g.data_index, "retries": g.retries,
                            "samples": [s.to_dict() for s in g.samples]} for g in groups]}

    def load_state_dict(self, state: dict) -> None:
        self.trainer_version, self.consumed_groups = state["trainer_version"], state["consumed_groups"]
        self.data.load_state_dict(state["data"])
        for g in state["groups"]:
            group = Group(g["group_id"], [Sample.from_dict(s) for s in g["samples"]], g["data_index"],
                          g.get("retries", 0))
            for s in group.samples:
                if s.status is SampleStatus.RUNNING:
                    s.status = SampleStatus.PARTIAL
            if group.finished and self._verdict(group) is None:
                self.ready.append(group)
            else:
                self.resume.append(group)
