"""The rollout manager's counters, and what each batch reports from them."""
from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from rollout.types import Group


LENGTH_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def length_bucket(n: int) -> str:
    """The bucket of a response of n generated tokens: '<=16', '<=32', ..., '>4096'."""
    return next((f"<={b}" for b in LENGTH_BUCKETS if n <= b), f">{LENGTH_BUCKETS[-1]}")


class LengthLedger:
    """Where every finished sample went, by response length: generated (it finished generating),
    then trained (handed to the trainer) or dropped (stale, filtered, failed: its group was thrown
    away or restarted); until then pending. Per bucket, samples and tokens add up:
    generated = trained + dropped + pending. `length_bias` = mean trained length / mean generated
    length: below 1 when the long samples are the ones that get dropped."""

    KINDS = ("generated", "trained", "dropped_stale", "dropped_filtered", "dropped_failed")

    def __init__(self):
        self.samples = {k: collections.Counter() for k in self.KINDS}
        self.tokens = {k: collections.Counter() for k in self.KINDS}
        self.pending: dict[str, int] = {}            # sample uid -> generated tokens

    def _add(self, kind: str, n: int) -> None:
        b = length_bucket(n)
        self.samples[kind][b] += 1
        self.tokens[kind][b] += n

    def finished(self, sample) -> None:
        if sample.uid not in self.pending:
            self.pending[sample.uid] = sample.num_generated
            self._add("generated", sample.num_generated)

    def trained(self, sample) -> None:
        self.finished(sample)                         # (one restored from a checkpoint was generated before)
        self._add("trained", self.pending.pop(sample.uid))

    def dropped(self, sample, reason: str) -> None:
        if sample.uid in self.pending:                # only finished samples: unfinished ones are in tokens_wasted
            kind = f"dropped_{reason}" if f"dropped_{reason}" in self.samples else "dropped_filtered"
            self._add(kind, self.pending.pop(sample.uid))

    def mean(self, kind: str) -> float:
        count = sum(self.samples[kind].values())
        return sum(self.tokens[kind].values()) / count if count else 0.0

    def snapshot(self) -> dict:
        generated, trained = self.mean("generated"), self.mean("trained")
        buckets = sorted(set().union(*self.samples.values()), key=lambda b: (b.startswith(">"), int(b.strip("<=>"))))
        pending, pending_tokens = collections.Counter(), collections.Counter()
        for n in self.pending.values():
            b = length_bucket(n)
            pending[b] += 1
            pending_tokens[b] += n
        return {"length_bias": trained / generated if generated and trained else 1.0,
                "generated_mean_len": generated, "trained_mean_len": trained,
                "by_length": {b: {**{k: self.samples[k][b] for k in self.KINDS}, "pending": pending[b]} for b in buckets},
                "tokens_by_length": {b: {**{k: self.tokens[k][b] for k in self.KINDS}, "pending": pending_tokens[b]}
                                     for b in buckets}}


@dataclass
class Totals:
    """Running totals of the rollout: as the manager counts them (RolloutMetrics) and as a batch
    reports them (BatchMetrics)."""
    samples_finished: int = 0
    tokens_generated: int = 0
    token_forwards: int = 0        # the forward passes those tokens came from (speculative decoding: fewer)
    spec_drafted: int = 0          # speculative decoding: tokens the servers drafted, and the policy accepted
    spec_accepted: int = 0
    prompt_tokens_cached: int = 0  # prompt positions the servers took from their KV caches, not prefilled
    prompt_tokens_old_kv: int = 0  # ... of those, positions whose KV older weights made (rollout.kv_policy=continue)
    tokens_aborted: int = 0        # tokens in requests cut short by an abort (kept: they resume)
    tokens_resumed: int = 0        # response tokens carried into a resumed request
    tokens_wasted: int = 0         # generated tokens thrown away (filtered, stale, failed groups)
    retries: int = 0
    stale_dropped: int = 0
    kept_past_patience: int = 0    # groups the filter rejected but kept (filter_patience)
    groups_failed: int = 0         # groups whose requests or reward failed (each retried, or dropped)
    last_error: str = ""           # what the last failed group failed with
    requests_doomed: int = 0       # in-flight requests stopped early: their group already broke the bound
    tokens_masked_old: int = 0     # stale_policy keep: trained-on tokens masked for being past max_token_age
    policy_aborts: int = 0         # weight updates at which the update policy aborted requests (partial rollout)
    policy_held: int = 0           # abort_furthest updates with requests in flight that aborted none: rollout
                                   # was not a batch ahead, so the trainer would have waited on the re-prefill
    waits_for_old: int = 0         # stale_policy wait: batches whose wait saw at-risk groups running
    wait_for_old_s: float = 0.0    # ... the trainer's wait for them (part of its wait for data)
    samples_scored: int = 0        # samples of whole groups scored, the filter's drops included
    reward_scored: float = 0.0     # ... their rewards' sum
    correct_scored: int = 0        # ... how many got full reward (>= 0.999)


@dataclass
class RolloutMetrics(Totals):
    """Running totals; `BatchReport` turns them into per-batch differences and gauges."""
    drops: collections.Counter = field(default_factory=collections.Counter)   # DropReason value -> groups
    tokens_by_server: collections.Counter = field(default_factory=collections.Counter)   # url -> tokens
    lengths: LengthLedger = field(default_factory=LengthLedger)

    def scored(self, rewards: list[float]) -> None:
        """A whole group's rewards, before the filter: with dynamic sampling (all_equal) the trained
        batch leaves out the groups a prompt already solves (all 1) or fails (all 0), so only these
        totals show the reward the policy gets."""
        self.samples_scored += len(rewards)
        self.reward_scored += sum(rewards)
        self.correct_scored += sum(r >= 0.999 for r in rewards)

    def totals(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Totals)}

    def snapshot(self) -> dict:
        """The totals, the drops and the length ledger's figures, as plain values (status, checkpoints)."""
        return {**self.totals(), "drops": dict(self.drops), **self.lengths.snapshot()}


@dataclass
class BatchMetrics(Totals, Mapping):
    """What the rollout reports with each batch (`TrainBatch.metrics`): the totals so far, the rates
    since the previous batch, the manager's gauges, the batch's own figures, and what the backend
    adds. Read by attribute; as a mapping it reads the same names flat (`m["staleness_max"]`,
    `m.items()`, the fleet's as "fleet/servers", ...), as the report's dict did."""
    drops: dict = field(default_factory=dict)              # DropReason value -> groups, so far
    length_bias: float = 1.0                               # LengthLedger's, so far
    generated_mean_len: float = 0.0
    trained_mean_len: float = 0.0
    by_length: dict = field(default_factory=dict)          # bucket -> samples generated / trained / dropped / pending
    tokens_by_length: dict = field(default_factory=dict)   # ... their tokens
    wait_s: float = 0.0                                    # the trainer's wait for this batch
    samples_per_s: float = 0.0                             # since the previous batch
    tokens_per_s: float = 0.0
    tokens_per_s_by_server: dict = field(default_factory=dict)
    inflight: int = 0                                      # gauges: requests, groups running and ready
    groups_running: int = 0
    groups_ready: int = 0
    staleness_hist: dict = field(default_factory=dict)     # versions behind the trainer -> samples
    staleness_max: int = 0
    reward_mean: float = 0.0                               # the trained batch
    scored_reward_mean: float = 0.0                        # every group scored since the last batch
    scored_accuracy: float = 0.0
    samples_scored_since: int = 0
    response_len_mean: float = 0.0
    trainer_version: int = 0
    overlong_penalty_mean: float | None = None             # the backend's, with trainer.overlong_buffer
    fleet: dict = field(default_factory=dict)              # the backend's: "fleet/servers", "fleet/evictions", ...

    def _flat(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "fleet"}
        if out["overlong_penalty_mean"] is None:
            del out["overlong_penalty_mean"]
        return {**out, **self.fleet}

    def __getitem__(self, name: str):
        return self._flat()[name]

    def __iter__(self):
        return iter(self._flat())

    def __len__(self) -> int:
        return len(self._flat())


class BatchReport:
    """The metrics of each batch handed out: counters, rates since the previous batch, gauges."""

    def __init__(self, metrics: RolloutMetrics):
        self.metrics = metrics
        self._last = (time.monotonic(), 0, 0)   # time, samples finished, tokens generated
        self._last_scored = (0, 0.0, 0)         # samples scored, their reward, full-reward samples
        self._last_by_server: collections.Counter = collections.Counter()

    def __call__(self, groups: list[Group], trainer_version: int, wait_s: float, gauges: dict) -> BatchMetrics:
        now, m = time.monotonic(), self.metrics
        t_prev, samples_prev, tokens_prev = self._last
        dt = max(now - t_prev, 1e-9)
        self._last = (now, m.samples_finished, m.tokens_generated)
        by_server = {url: (n - self._last_by_server[url]) / dt for url, n in m.tokens_by_server.items()}
        self._last_by_server = collections.Counter(m.tokens_by_server)
        samples = [s for g in groups for s in g.samples]
        trained_reward = sum(s.reward for s in samples) / len(samples)
        scored = (m.samples_scored, m.reward_scored, m.correct_scored)
        n, total, correct = (a - b for a, b in zip(scored, self._last_scored))
        self._last_scored = scored
        staleness = collections.Counter(s.staleness(trainer_version) for s in samples)
        return BatchMetrics(
            **m.totals(), drops=dict(m.drops), **m.lengths.snapshot(),
            wait_s=wait_s,
            samples_per_s=(m.samples_finished - samples_prev) / dt,
            tokens_per_s=(m.tokens_generated - tokens_prev) / dt,
            tokens_per_s_by_server=by_server,
            **gauges,
            staleness_hist=dict(sorted(staleness.items())),
            staleness_max=max(staleness),
            reward_mean=trained_reward,        # the trained batch
            # every group scored since the last batch, filtered ones included (the batch's own
            # groups when it was ready before then)
            scored_reward_mean=total / n if n else trained_reward,
            scored_accuracy=correct / n if n else sum(s.reward >= 0.999 for s in samples) / len(samples),
            samples_scored_since=n,
            response_len_mean=sum(len(s.response_ids) for s in samples) / len(samples),
            trainer_version=trainer_version)
