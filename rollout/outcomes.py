"""What becomes of a finished group, for the rollout manager (manager.py): ready for a batch, run
again, or dropped, with the bookkeeping each takes (metrics, the drop record, the failure streak
that stops the manager)."""
from __future__ import annotations

import logging

from rollout.types import DropReason, Group, SampleStatus

log = logging.getLogger("rollout.manager")      # the manager's logger: its records keep their name


class GroupOutcomes:
    """RolloutManager's part that settles finished groups. It works on the manager's own state:
    cfg, metrics, staleness, group_filter, on_drop, ready, resume, dropped, fatal, _filtered and
    _failed_streak (set in RolloutManager.__init__)."""

    def _filter(self, group: Group) -> None:
        self.metrics.scored(group.rewards)
        reason = self.group_filter(group)
        if reason is not None:
            # Like verl's max_num_gen_batches: a converged model makes most groups all-equal;
            # past the patience, keep them (zero advantage) rather than starve the trainer.
            patience = self.cfg.filter_patience
            if not (patience and self._filtered >= patience):
                self._filtered += 1
                self._drop(group, reason)
                return
            self.metrics.kept_past_patience += 1
        self._failed_streak = 0
        self.ready.append(group)

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
            self._drop(group, DropReason.FAILED)
            return
        group.retries += 1
        self.metrics.tokens_wasted += sum(s.num_generated for s in group.samples)
        for s in group.samples:
            self.metrics.lengths.dropped(s, "failed")
            s.reset()
            s.num_retries = 0
        self.resume.append(group)

    def _drop(self, group: Group, reason: DropReason | str) -> None:
        if self.on_drop is not None:
            self.on_drop(group, reason)
        self.metrics.drops[getattr(reason, "value", reason)] += 1
        self.metrics.tokens_wasted += sum(s.num_generated for s in group.samples)
        kind = {DropReason.STALE: "stale", DropReason.FAILED: "failed"}.get(reason, "filtered")
        for s in group.samples:
            self.metrics.lengths.dropped(s, kind)
        if reason is DropReason.STALE:
            self.metrics.stale_dropped += len(group.samples)
            if self.staleness.regenerates:
                for s in group.samples:
                    s.reset()
                self.resume.append(group)
                return
        self.dropped.append(f"{group.group_id}:{getattr(reason, 'value', reason)}")
