"""Moved to rollout.tasks (the rollout process scores with these and must not load trainer_bridge).
Kept so that configs and checkpoints written before, which name
`trainer_bridge.tasks:partial_credit`, still load."""
from rollout.tasks import (DIGIT_TASKS, dataset_items, digit_items, partial_credit,  # noqa: F401
                           partial_credit_score, reasoning_gym_score)
