"""The rollout manager: keeps the servers busy with GRPO groups and hands out ready batches.

The flow: produce groups (oversampling: `groups_in_progress` running or ready at once, and no more
than staleness capacity allows) -> run each sample through the rollout function -> filter the
finished group -> hand out `batch_size` ready groups to the trainer. Requests (slots, failover,
aborts) live in `requests.py`, every staleness decision in `staleness.py`, what becomes of a finished
group (ready, run again or dropped, and the bookkeeping) in `outcomes.py`.

`stale_policy` says what happens to a group past the bound: dropped, regenerated, kept (its too-old
tokens masked), or, with `wait`, it never gets there: batches take the oldest groups first and wait
for at-risk ones still running.

A new weight version aborts the in-flight requests furthest from finishing (`update_policy`); an
aborted sample keeps its tokens, logprobs and versions and resumes at once under the new weights.
A group whose requests still fail runs its prompt again (`max_group_retries`); `max_failed_groups`
failed groups in a row stop the manager with the error instead of burning through the data.
`stop()` aborts everything in flight and keeps it as partial samples, waiting at most
`progress_timeout_s` for a hung server; with `state_dict()` they survive a restart, together with
the data position.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from typing import Callable

from rollout.agent import RolloutFn, single_turn
from rollout.client import RequestRefused, ServerError
from rollout.config import RolloutConfig, UpdatePolicy
from rollout.context import RolloutContext
from rollout.data import PromptSource, prompt_ids
from rollout.filters import GroupFilter, all_equal
from rollout.metrics import BatchReport, RolloutMetrics
from rollout.outcomes import GroupOutcomes
from rollout.requests import Requests, RolloutStopped
from rollout.rewards import RewardFn
from rollout.router import NoServerAvailable, Router
from rollout.staleness import StaleSample, Staleness
from rollout.types import DropReason, Group, Sample, SampleStatus

log = logging.getLogger(__name__)


class RolloutManager(GroupOutcomes):
    def __init__(self, cfg: RolloutConfig, router: Router, data: PromptSource, tokenizer, reward_fn: RewardFn,
                 rollout_fn: RolloutFn = single_turn, group_filter: GroupFilter = all_equal,
                 on_drop: Callable[[Group, "DropReason | str"], None] | None = None):
        self.cfg = cfg.validate()
        self.on_drop = on_drop                       # called with every group dropped, and why
        self.router, self.data, self.tokenizer = router, data, tokenizer
        self._chat = cfg.chat_template(tokenizer)
        router.watch_progress(cfg.progress_timeout_s)
        self.reward_fn, self.rollout_fn, self.group_filter = reward_fn, rollout_fn, group_filter
        self.trainer_version = 0
        self.consumed_groups = 0
        self.metrics = RolloutMetrics()
        self.staleness = Staleness(cfg.max_staleness, cfg.batch_size, cfg.stale_policy, cfg.max_token_age,
                                   cfg.on_policy_warmup)
        self.requests = Requests(cfg, router, self.metrics, self.admit, lambda: self.trainer_version)
        self.running: dict[str, Group] = {}
        self.ready: collections.deque[Group] = collections.deque()
        self.resume: collections.deque[Group] = collections.deque()
        self.tasks: set[asyncio.Task] = set()
        self.stopping = False
        self.fatal: Exception | None = None          # an error every request would hit: stop and say it
        self._filtered = 0                           # filter drops since the last batch went out
        self.dropped: list[str] = []                 # "group_id:reason" of every group dropped for good
        self._failed_streak = 0                      # failed groups since the last one that succeeded
        self._producer: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._report = BatchReport(self.metrics)

    @property
    def inflight(self):
        return self.requests.inflight

    # ---- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        self.stopping, self.fatal = False, None
        self.staleness.start(self.trainer_version, self.consumed_groups)
        self.requests.reset()
        self._wake_producer, self._wake_consumer = asyncio.Event(), asyncio.Event()
        self._producer = asyncio.create_task(self._produce(), name="rollout-producer")
        self._watcher = asyncio.create_task(self.router.watch(), name="router-watch")

    async def stop(self) -> None:
        """Abort everything in flight; unfinished groups stay as partial groups (see state_dict).
        A server that does not give its requests back within `progress_timeout_s` is not waited
        for: those requests are cancelled and their samples keep the tokens they had."""
        self.stopping = True
        self._notify()
        aborting = asyncio.ensure_future(self.requests.abort(list(self.inflight)))
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
                self._spawn(self._run_group(group), f"group-{group.group_id}")
                continue
            self._wake_producer.clear()
            try:
                await asyncio.wait_for(self._wake_producer.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass

    def _may_start(self) -> bool:
        in_progress = len(self.running) + len(self.ready)
        return (self.fatal is None and self.router.any_up()
                and in_progress < self.cfg.groups_in_progress
                and self.staleness.may_start(self.trainer_version, self.consumed_groups, in_progress))

    def _new_group(self) -> Group:
        item = self.data.next()
        ids = prompt_ids(self.tokenizer, item.prompt, self._chat)
        gid = f"g{item.index}"
        samples = [Sample(gid, i, list(ids), item.prompt, item.label, metadata=dict(item.metadata))
                   for i in range(self.cfg.group_size)]
        return Group(gid, samples, item.index)

    # ---- a group: run its samples, then filter it --------------------------------------------------
    async def _run_group(self, group: Group) -> None:
        try:
            results = await asyncio.gather(*(self._run_sample(s) for s in group.samples if not s.status.finished),
                                           return_exceptions=True)
            if any(isinstance(r, RolloutStopped) for r in results) or self.stopping:
                return                                  # stays in `running`; stop() keeps it for resume
            self.running.pop(group.group_id, None)
            if any(isinstance(r, StaleSample) for r in results):
                self._drop(group, DropReason.STALE)
            elif any(s.status is SampleStatus.FAILED for s in group.samples):
                self._group_failed(group)
            else:
                self._filter(group)
        finally:
            self._notify()

    async def _run_sample(self, sample: Sample) -> None:
        try:
            ctx = RolloutContext(sample, self.tokenizer, self.cfg.sampling_params(), self.requests)
            await self.rollout_fn(sample, ctx)
            await ctx.end_episode()
        except (RolloutStopped, StaleSample):
            raise
        except RequestRefused as e:
            if e.refuses_sampling_params:
                self._refused_config(sample, e)          # raises RolloutStopped
            sample.status, sample.error = SampleStatus.FAILED, str(e)
            return
        except (ServerError, NoServerAvailable, ValueError) as e:
            sample.status, sample.error = SampleStatus.FAILED, str(e)
            return
        sample.response_text = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        try:
            sample.reward = float(await self.reward_fn(sample))
        except Exception as e:  # a user's reward function: record the error on the sample, keep running
            log.warning("reward function failed on sample %s: %r", sample.uid, e)
            sample.status, sample.error = SampleStatus.FAILED, f"reward function raised {e!r}"
        self.metrics.samples_finished += 1
        self.metrics.lengths.finished(sample)

    def _refused_config(self, sample: Sample, error: RequestRefused) -> None:
        """The server refuses the rollout config itself (e.g. max_new_tokens past its context): every
        request would fail the same way, so stop and tell the trainer; the sample keeps what it had
        and its prompt is not used up."""
        if self.fatal is None:
            self.fatal = error
            log.error("rollout stopped: %s", error)
        sample.status = SampleStatus.PARTIAL if sample.response_ids else SampleStatus.PENDING
        self._notify()
        raise RolloutStopped() from error

    def admit(self, sample: Sample) -> None:
        """Before every request of a trajectory: the manager still runs, and the sample's group
        (consumed whole) is still within the staleness bound."""
        if self.stopping:
            raise RolloutStopped()
        self.staleness.admit(self.running.get(sample.group_id, sample), self.trainer_version)

    # ---- the trainer's side ----------------------------------------------------------------------
    async def next_batch(self, as_of: int | None = None) -> tuple[list[Group], dict]:
        """Wait for `batch_size` groups that passed the filter and the staleness bound. `as_of`: the
        version the batch trains, when the trainer takes it while that version's push is still in
        flight (the bound is judged against it, as it will be once the push lands)."""
        t0, waited_from = time.monotonic(), None
        version = self._as_of(as_of)
        while True:
            ready, risky = self._batch_ready(version)
            if ready:
                break
            if waited_from is None and risky:
                waited_from = time.monotonic()
            if self.fatal is not None:
                raise RuntimeError(f"the rollout manager stopped: {self.fatal}") from self.fatal
            if self.stopping:
                raise RuntimeError("the rollout manager is stopped")
            self._wake_consumer.clear()
            await self._wake_consumer.wait()
        if waited_from is not None:
            self.metrics.waits_for_old += 1
            self.metrics.wait_for_old_s += time.monotonic() - waited_from
        ordered = self.staleness.batch_order(self.ready, version)
        groups, self.ready = ordered[:self.cfg.batch_size], collections.deque(ordered[self.cfg.batch_size:])
        self.consumed_groups += len(groups)
        for g in groups:
            for s in g.samples:
                self.metrics.lengths.trained(s)
                self.metrics.tokens_masked_old += self.staleness.mask_old(s, version)
        self._filtered = 0
        self._notify()
        gauges = {"inflight": len(self.inflight), "groups_running": len(self.running), "groups_ready": len(self.ready)}
        return groups, self._report(groups, version, time.monotonic() - t0, gauges)

    def batch_ready(self, as_of: int | None = None) -> bool:
        """Whether next_batch(as_of) would return now (the stale groups it would drop are dropped)."""
        return self._batch_ready(self._as_of(as_of))[0]

    def _as_of(self, as_of: int | None) -> int:
        """The version a batch is judged against: the trainer's, or the next one, whose push is in flight."""
        if as_of is None or as_of == self.trainer_version:
            return self.trainer_version
        if as_of != self.trainer_version + 1:
            raise ValueError(f"next_batch(as_of={as_of}): the trainer is at version {self.trainer_version}; a batch "
                             f"may be taken for it or for the next version only")
        return as_of

    def _batch_ready(self, version: int) -> tuple[bool, list]:
        for group in [g for g in self.ready if not self.staleness.consumable(g, version)]:
            self.ready.remove(group)
            self._drop(group, DropReason.STALE)
        risky = self.staleness.risky(self.running.values(), version)
        ready = len(self.ready) >= self.cfg.batch_size and not self.staleness.waits_for_old(self.ready, risky, version)
        return ready, risky

    async def on_weights_updated(self, version: int, wait: bool = False, on_policy: bool = False) -> None:
        """The trainer published `version`: apply the in-flight policy; aborted samples resume on it.
        The aborts go out in the background unless `wait`: the trainer need not wait for them.
        Requests of groups already past the bound stop now, whatever the policy: every further
        token of theirs would be thrown away. `on_policy`: the next batch is generated on `version`
        alone (bound 0 at it: rollout.on_policy_warmup_kl's warm-up)."""
        if on_policy:
            self.staleness.hold_on_policy(version)
        self.trainer_version = version
        doomed = self.staleness.doomed(((rid, r.sample.group_id, r.version) for rid, r in self.inflight.items()),
                                       self.running, version)
        rids = self._policy_aborts(set(doomed)) + doomed
        self.metrics.requests_doomed += len(doomed)
        task = self._spawn(self.requests.abort(rids), f"abort-for-v{version}")
        if wait:
            await task
        self._notify()

    def _policy_aborts(self, skip: set[str]) -> list[str]:
        # stale_policy wait: the next batch waits on the at-risk groups; an abort would only add a
        # re-prefill to that wait
        risky = {g.group_id for g in self.staleness.risky(self.running.values(), self.trainer_version)}
        rids = [rid for rid, r in self.inflight.items() if rid not in skip and r.sample.group_id not in risky]
        policy = self.cfg.update_policy
        if policy is UpdatePolicy.abort_all:
            self.metrics.policy_aborts += bool(rids)
            return rids
        # abort_furthest, only while rollout is a batch ahead of the trainer (the next two batches
        # ready): short of that the trainer will wait on these very requests, and an abort would add
        # their re-prefill to its wait; a batch ahead, rollout has time to spare, and it goes to
        # redoing the longest requests' remaining tokens under the new weights.
        if policy is UpdatePolicy.abort_furthest and rids:
            if not self.staleness.ahead(self.ready, self.trainer_version):
                self.metrics.policy_held += 1
                return []
            rids.sort(key=self.requests.tokens_left, reverse=True)
            chosen = rids[:math.ceil(len(rids) * self.cfg.abort_fraction)]
            self.metrics.policy_aborts += bool(chosen)
            return chosen
        return []

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _notify(self) -> None:
        self._wake_producer.set()
        self._wake_consumer.set()

    # ---- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Call after stop(): every unconsumed group, partial ones included, and the data position."""
        groups = [*self.ready, *self.resume, *self.running.values()]
        return {"trainer_version": self.trainer_version, "consumed_groups": self.consumed_groups,
                "data": self.data.state_dict(), "metrics": self.metrics.snapshot(), "dropped": list(self.dropped),
                "groups": [{"group_id": g.group_id, "data_index": g.data_index, "retries": g.retries,
                            "samples": [s.to_dict() for s in g.samples]} for g in groups]}

    def load_state_dict(self, state: dict) -> None:
        self.trainer_version, self.consumed_groups = state["trainer_version"], state["consumed_groups"]
        self.data.load_state_dict(state["data"])
        self.dropped = list(state.get("dropped", []))
        for g in state["groups"]:
            group = Group(g["group_id"], [Sample.from_dict(s) for s in g["samples"]], g["data_index"],
                          g.get("retries", 0))
            for s in group.samples:
                if s.status is SampleStatus.RUNNING:
                    s.status = SampleStatus.PARTIAL
            failed = any(s.status is SampleStatus.FAILED for s in group.samples)
            if group.finished and not failed and self.group_filter(group) is None:
                self.ready.append(group)
            else:
                self.resume.append(group)
