"""Riptide for trainers. The door is the attach API:

    from trainer_bridge import RolloutBackend, BackendConfig, TrainBatch

`backend.py` (RolloutBackend: servers, weight sync and the rollout manager behind `next_batch` and
`push_weights`) and `batch.py` (TrainBatch). Behind it, one room per concern:

- `fleets/`: where servers and the rollout manager run (`local.py` subprocesses, `ray_cluster.py`).
- `training/`: the built-in GRPO trainer (`grpo.py` the math, `trainer.py`), and its k ranks
  (`ranks.py`).
- `job/`: a riptide-train job top to bottom (`run.py`), what it reports (`monitor.py`), and the
  process entry of trainer ranks k > 0 (`rank_entry.py`, which runs the same job);
  `train.py` here is the Hydra entry (`riptide-train`), `config.py` the schema every part reads.
"""
from __future__ import annotations

__all__ = ["BackendConfig", "RolloutBackend", "TrainBatch"]


def __getattr__(name: str):
    # imported on first use: `python -m trainer_bridge.train` and the rank processes need not load it
    if name in ("BackendConfig", "RolloutBackend"):
        from trainer_bridge import backend
        return getattr(backend, name)
    if name == "TrainBatch":
        from trainer_bridge.batch import TrainBatch
        return TrainBatch
    raise AttributeError(f"module 'trainer_bridge' has no attribute {name!r}")
