"""The rollout manager's counters, and what each batch reports from them."""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from rollout.types import Group


@dataclass
class RolloutMetrics:
    """Running totals; `BatchReport` turns them into per-batch differences and gauges."""
    samples_finished: int = 0
    tokens_generated: int = 0
    tokens_aborted: int = 0        # tokens in requests cut short by an abort (kept: they resume)
    tokens_resumed: int = 0        # response tokens carried into a resumed request
    tokens_wasted: int = 0         # generated tokens thrown away (filtered, stale, failed groups)
    retries: int = 0
    drops: collections.Counter = field(default_factory=collections.Counter)   # DropReason value -> groups
    stale_dropped: int = 0
    kept_past_patience: int = 0    # groups the filter rejected but kept (filter_patience)
    groups_failed: int = 0         # groups whose requests or reward failed (each retried, or dropped)
    last_error: str = ""           # what the last failed group failed with
    requests_doomed: int = 0       # in-flight requests stopped early: their group already broke the bound
    policy_aborts: int = 0         # weight updates at which the update policy aborted requests (partial rollout)
    policy_held: int = 0           # abort_furthest updates with requests in flight that aborted none: rollout
                                   # was not a batch ahead, so the trainer would have waited on the re-prefill
    tokens_by_server: collections.Counter = field(default_factory=collections.Counter)   # url -> tokens

    def snapshot(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("drops", "tokens_by_server")}
        d["drops"] = dict(self.drops)
        return d


class BatchReport:
    """The metrics of each batch handed out: counters, rates since the previous batch, gauges."""

    def __init__(self, metrics: RolloutMetrics):
        self.metrics = metrics
        self._last = (time.monotonic(), 0, 0)   # time, samples finished, tokens generated
        self._last_by_server: collections.Counter = collections.Counter()

    def __call__(self, groups: list[Group], trainer_version: int, wait_s: float, gauges: dict) -> dict:
        now, m = time.monotonic(), self.metrics
        t_prev, samples_prev, tokens_prev = self._last
        dt = max(now - t_prev, 1e-9)
        self._last = (now, m.samples_finished, m.tokens_generated)
        by_server = {url: (n - self._last_by_server[url]) / dt for url, n in m.tokens_by_server.items()}
        self._last_by_server = collections.Counter(m.tokens_by_server)
        samples = [s for g in groups for s in g.samples]
        staleness = collections.Counter(s.staleness(trainer_version) for s in samples)
        return {
            **m.snapshot(),
            "wait_s": wait_s,
            "samples_per_s": (m.samples_finished - samples_prev) / dt,
            "tokens_per_s": (m.tokens_generated - tokens_prev) / dt,
            "tokens_per_s_by_server": by_server,
            **gauges,
            "staleness_hist": dict(sorted(staleness.items())),
            "max_staleness": max(staleness),
            "reward_mean": sum(s.reward for s in samples) / len(samples),
            "response_len_mean": sum(len(s.response_ids) for s in samples) / len(samples),
            "trainer_version": trainer_version,
        }
