"""Group filters: `(group) -> reason to drop, or None to keep`."""
from __future__ import annotations

from typing import Callable

from rollout.types import Group

GroupFilter = Callable[[Group], "str | None"]


def all_equal(group: Group) -> str | None:
    """DAPO's dynamic sampling: a group whose rewards are all equal has zero advantage everywhere."""
    rewards = group.rewards
    return "all_equal_rewards" if max(rewards) - min(rewards) < 1e-9 else None


def keep_all(group: Group) -> str | None:
    return None


BUILTIN = {"all_equal": all_equal, "none": keep_all}


def get_filter(spec: str) -> GroupFilter:
    from rollout.rewards import load_callable
    return BUILTIN[spec] if spec in BUILTIN else load_callable(spec)
