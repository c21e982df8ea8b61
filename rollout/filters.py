"""Group filters: `(group) -> reason to drop, or None to keep`."""
from __future__ import annotations

from typing import Callable

from rollout.types import DropReason, Group

GroupFilter = Callable[[Group], "DropReason | str | None"]


def all_equal(group: Group) -> DropReason | None:
    """DAPO's dynamic sampling: a group whose rewards are all equal has zero advantage everywhere."""
    rewards = group.rewards
    return DropReason.ALL_EQUAL if max(rewards) - min(rewards) < 1e-9 else None


def keep_all(group: Group) -> None:
    return None


BUILTIN = {"all_equal": all_equal, "none": keep_all}


def get_filter(spec: str) -> GroupFilter:
    from rollout.rewards import load_callable
    return BUILTIN[spec] if spec in BUILTIN else load_callable(spec)
