"""Staleness: every decision about how old a group's tokens may be, from one formula.

A token generated under weight version v is `trainer_version - v` versions stale, and a group is
trained on whole, so a group is `consumable` while its oldest token is within `max_staleness`
(`Group.staleness(trainer_version) <= max_staleness`). Each point where age matters asks here:

- `may_start` (capacity, as AReaL): a group started now is consumed before the trainer passes
  version trainer_version + max_staleness, given one batch per version, while
  consumed + in_progress < (trainer_version + max_staleness + 1) * batch_size, counted from start();
- `admit`, before every request of a trajectory: a group that already broke the bound stops,
  siblings included (their tokens could never be trained);
- `doomed`, when a version lands: requests in flight whose group can no longer be consumed in time
  (a token of it is too old, or a request has run since a version that now is);
- `consumable`, at hand-out; `ahead`, whether the next two batches are ready and consumable;
- `at_risk` (stale_policy wait): a group the next version would put past the bound, so the batch
  handed out now must take it.
"""
from __future__ import annotations

from typing import Iterable

from rollout.types import Group, Sample


class StaleSample(Exception):
    """A trajectory would exceed max_staleness: dropped or regenerated, by config."""


class Staleness:
    def __init__(self, max_staleness: int, batch_size: int, keep: bool = False):
        """`keep` (stale_policy keep): the bound paces admission only; nothing is stopped or
        refused for its age (the trainer masks tokens past max_token_age instead)."""
        self.bound, self.batch_size, self.keep = max_staleness, batch_size, keep
        self._base = (0, 0)                  # trainer version and consumed groups at start()

    def start(self, trainer_version: int, consumed: int) -> None:
        self._base = (trainer_version, consumed)

    def consumable(self, group: Group, trainer_version: int) -> bool:
        return self.keep or group.staleness(trainer_version) <= self.bound

    def at_risk(self, group: Group, trainer_version: int) -> bool:
        """Its oldest token is `bound` versions old: consumable now, not after the next version."""
        return any(s.min_version is not None for s in group.samples) and \
            group.staleness(trainer_version) >= self.bound

    def may_start(self, trainer_version: int, consumed: int, in_progress: int) -> bool:
        base_version, base_consumed = self._base
        capacity = (trainer_version - base_version + self.bound + 1) * self.batch_size
        return consumed - base_consumed + in_progress < capacity

    def admit(self, trajectory: Group | Sample, trainer_version: int) -> None:
        """Raise StaleSample when `trajectory` (its group, or a sample outside any group) is past the bound."""
        age = trajectory.staleness(trainer_version)
        if age > self.bound and not self.keep:
            raise StaleSample(f"group {trajectory.group_id}: tokens from version {trainer_version - age}, "
                              f"trainer at {trainer_version}, bound {self.bound}")

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
                  if trainer_version - version > self.bound
                  or (gid in running and not self.consumable(running[gid], trainer_version))}
        return [rid for rid, gid, _ in requests if gid in doomed]

    def ahead(self, ready: Iterable[Group], trainer_version: int) -> bool:
        """Groups ready and consumable for the next two batches."""
        return sum(self.consumable(g, trainer_version) for g in ready) >= 2 * self.batch_size
