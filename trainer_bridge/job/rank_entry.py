"""Trainer rank k > 0 started as a process by rank 0 (trainer_bridge.training.ranks._LocalRanks):

    python -m trainer_bridge.job.rank_entry <job pickle>

In job/, beside the job it runs: training/ranks.py starts it by module name and imports nothing of job/."""
from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
from pathlib import Path

import torch

from platforms.process import watch_parent
from trainer_bridge.config import JobConfig
from trainer_bridge.job.run import run


def main(spec: str) -> None:
    """A rank started by rank 0: the job from its pickle, the group from the environment."""
    watch_parent(int(os.environ["RIPTIDE_PARENT_PID"]))
    for sig in (signal.SIGINT, signal.SIGTERM):      # rank 0 decides when the job stops
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s rank %(process)d %(levelname)s %(message)s")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    job: JobConfig = pickle.loads(Path(spec).read_bytes())
    run(job)
    # the group is gone; the transfer engine's teardown joins a thread that polls once a second
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
