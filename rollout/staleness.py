"""Staleness: every decision about how old a group's tokens may be, from one formula and one policy.

A token generated under weight version v is `trainer_version - v` versions stale, and a group is
trained on whole, so a group is `consumable` while its oldest token is within the bound,
`rollout.max_staleness` (`Group.staleness(trainer_version) <= bound`). What the bound means depends
on `stale_policy` (config.StalePolicy): with drop / regenerate / wait no trained token is older than
the bound; with keep (the default) the bound paces admission only and tokens older than
`max_token_age` are masked. The batch metric `staleness_max` is what was observed. Each point where
age matters asks here:

- `may_start` (capacity, as AReaL): a group started now is consumed before the trainer passes
  version trainer_version + bound, given one batch per version, while
  consumed + in_progress < (trainer_version + bound + 1) * batch_size, counted from start();
- `admit`, before every request of a trajectory: a group that already broke the bound stops,
  siblings included (their tokens could never be trained);
- `doomed`, when a version lands: requests in flight whose group can no longer be consumed in time
  (a token of it is too old, or a request has run since a version that now is);
- `consumable`, at hand-out; `ahead`, whether the next two batches are ready and consumable;
- `risky` / `waits_for_old` / `batch_order` (wait): groups the next version would put past the
  bound, whether the batch waits for those still running, and the oldest ready groups first;
- `regenerates` (regenerate): a group dropped for its age runs again; `mask_old` (keep): the
  tokens past max_token_age leave the loss.
"""
from __future__ import annotations

from typing import Iterable

from rollout.config import StalePolicy
from rollout.types import Group, Sample


class StaleSample(Exception):
    """A trajectory would exceed max_staleness: dropped or regenerated, by config."""


class Staleness:
    def __init__(self, max_staleness: int, batch_size: int, policy: StalePolicy = StalePolicy.drop,
                 max_token_age: int = -1, on_policy_warmup: int = 0):
        """Under `policy` keep the bound paces admission only; nothing is stopped or refused for its
        age (tokens past `max_token_age` are masked instead). Before version `on_policy_warmup` the
        bound is 0: the first batches are generated on the weights they train, as in sync mode."""
        self.max_staleness, self.batch_size, self.policy = max_staleness, batch_size, policy
        self.max_token_age, self.warmup = max_token_age, on_policy_warmup
        self._base = (0, 0)                  # trainer version and consumed groups at start()

    def bound_at(self, trainer_version: int) -> int:
        """The bound in force at `trainer_version`: 0 during the on-policy warm-up, then max_staleness."""
        return 0 if trainer_version < self.warmup else self.max_staleness

    def hold_on_policy(self, trainer_version: int) -> None:
        """Keep the bound at 0 at `trainer_version` too (the adaptive warm-up: the trainer's last
        update was large)."""
        self.warmup = max(self.warmup, trainer_version + 1)

    @property
    def keep(self) -> bool:
        return self.policy is StalePolicy.keep

    @property
    def regenerates(self) -> bool:
        return self.policy is StalePolicy.regenerate

    def start(self, trainer_version: int, consumed: int) -> None:
        self._base = (trainer_version, consumed)

    def consumable(self, group: Group, trainer_version: int) -> bool:
        return self.keep or group.staleness(trainer_version) <= self.bound_at(trainer_version)

    def at_risk(self, group: Group, trainer_version: int) -> bool:
        """Its oldest token is `bound` versions old: consumable now, not after the next version."""
        return any(s.min_version is not None for s in group.samples) and \
            group.staleness(trainer_version) >= self.bound_at(trainer_version)

    def may_start(self, trainer_version: int, consumed: int, in_progress: int) -> bool:
        base_version, base_consumed = self._base
        capacity = (trainer_version - base_version + self.bound_at(trainer_version) + 1) * self.batch_size
        return consumed - base_consumed + in_progress < capacity

    def admit(self, trajectory: Group | Sample, trainer_version: int) -> None:
        """Raise StaleSample when `trajectory` (its group, or a sample outside any group) is past the bound."""
        age = trajectory.staleness(trainer_version)
        if age > self.bound_at(trainer_version) and not self.keep:
            raise StaleSample(f"group {trajectory.group_id}: tokens from version {trainer_version - age}, "
                              f"trainer at {trainer_version}, bound {self.bound_at(trainer_version)}")

    def doomed(self, requests: Iterable[tuple[str, str, int]], running: dict[str, Group],
               trainer_version: int) -> list[str]:
        """Of `requests` (rid, group id, trainer version when it was sent), those whose group can no
        longer be consumed within the bound. A false alarm costs one resume: an abort returns the
        tokens with their versions, and admission decides on those."""
        requests = list(requests)
        if self.keep:
            return []
        oldest: dict[str, int] = {}
        for _, gid, version in requests:
            oldest[gid] = min(oldest.get(gid, version), version)
        doomed = {gid for gid, version in oldest.items()
                  if trainer_version - version > self.bound_at(trainer_version)
                  or (gid in running and not self.consumable(running[gid], trainer_version))}
        return [rid for rid, gid, _ in requests if gid in doomed]

    def ahead(self, ready: Iterable[Group], trainer_version: int) -> bool:
        """Groups ready and consumable for the next two batches."""
        return sum(self.consumable(g, trainer_version) for g in ready) >= 2 * self.batch_size

    # ---- stale_policy wait ----------------------------------------------------------------------
    def risky(self, running: Iterable[Group], trainer_version: int) -> list[Group]:
        """stale_policy wait: running groups the next version would put past the bound (their
        requests are not aborted for a new version: that would only add a re-prefill to the wait)."""
        if self.policy is not StalePolicy.wait:
            return []
        return [g for g in running if self.at_risk(g, trainer_version)]

    def waits_for_old(self, ready: Iterable[Group], risky_running: list[Group], trainer_version: int) -> bool:
        """With a batch's worth ready: wait while an at-risk group still runs and the at-risk
        groups ready leave it room in the batch."""
        if not risky_running:
            return False
        return sum(self.at_risk(g, trainer_version) for g in ready) < self.batch_size

    def batch_order(self, ready: Iterable[Group], trainer_version: int) -> list[Group]:
        """The order batches take ready groups in: as they came, or with stale_policy wait the oldest
        first (earliest deadline first: a group's deadline is its oldest token's version + bound),
        so the at-risk ones go now and fewer come due together later."""
        if self.policy is not StalePolicy.wait:
            return list(ready)
        return sorted(ready, key=lambda g: g.staleness(trainer_version), reverse=True)

    # ---- stale_policy keep ----------------------------------------------------------------------
    def mask_old(self, sample: Sample, trainer_version: int) -> int:
        """stale_policy keep: tokens more than max_token_age versions behind the trainer leave the
        loss (loss_mask 0); the rest of the sample is trained on. Returns how many were masked."""
        if not self.keep or self.max_token_age < 0:
            return 0
        masked = 0
        for i, v in enumerate(sample.versions):
            if v >= 0 and sample.loss_mask[i] and trainer_version - v > self.max_token_age:
                sample.loss_mask[i] = 0
                masked += 1
        return masked
