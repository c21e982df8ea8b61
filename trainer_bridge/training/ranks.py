"""The built-in trainer on k processes: `trainer.world_size=k`.

Rank 0 is the job itself (the backend, the monitor, the checkpoints' rollout state); ranks 1..k-1
train and push and nothing else. Under `torchrun` (RANK and WORLD_SIZE in the environment, on one
machine or several) every process runs `riptide-train` and takes its rank from torchrun. Otherwise
rank 0 starts the others: under `cluster=local` as processes on this machine (`python -m
trainer_bridge.training.ranks JOB`, over loopback, each with its share of the cores; a rank whose parent is
gone kills itself), under `cluster=ray` as Ray actors in a placement group (`ray_fleet.RayRanks`,
`cluster.trainer_cpus` and an accelerator each), meeting rank 0 at its node's address. Rank 0
stops them when it ends, however it ends. The ranks form a torch.distributed group (gloo on CPU,
nccl on CUDA, hccl on NPU) and the trainer shards the model over it with FSDP2.

Rank 0 leads: before each thing the ranks do together it tells them which (`Lead`): train on this
batch (every rank gets the whole batch and takes its share of the rows), then the sharded weight
push (rank 0 through `backend.push_weights`, the others `push_sharded`); save a checkpoint; stop.
A rank started here ignores Ctrl-C and SIGTERM: the job's rank 0 decides when to stop, after the
step in progress and a checkpoint that needs every rank.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import logging
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from platforms import usable_cores
from platforms.process import free_port
from trainer_bridge.batch import TrainBatch
from trainer_bridge.config import ConfigError, JobConfig, redacted
from weight_sync.sharded import announce, listen

log = logging.getLogger(__name__)
class Order(str, enum.Enum):
    """What rank 0's Lead tells the other ranks before each collective step: (Order, ...)."""
    TRAIN = "train"        # (step, the batch's fields, measure: update_kl after the push)
    SAVE = "save"          # (step, checkpoint directory)
    STOP = "stop"
FIELDS = tuple(f.name for f in dataclasses.fields(TrainBatch) if f.name not in ("samples", "metrics"))   # the tensors


class Lead:
    """Rank 0's side: tells the other ranks what comes next (nothing to tell with one rank)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def train(self, step: int, batch: TrainBatch, measure: bool = False) -> None:
        self._tell((Order.TRAIN, step, {name: getattr(batch, name) for name in FIELDS}, measure))

    def save(self, step: int, directory: Path) -> None:
        self._tell((Order.SAVE, step, str(directory)))

    def stop(self) -> None:
        """At the end, also after a failure: a rank that is gone cannot be told."""
        try:
            self._tell((Order.STOP,))
        except Exception as e:      # noqa: BLE001  the group broke: the ranks are stopped by the launcher
            log.warning("could not tell the other trainer ranks to stop: %s", e)

    def _tell(self, message) -> None:
        if self.world > 1:
            announce(message)


def follow(model, trainer, first_step: int) -> None:
    """Ranks 1..k-1: the first push (the backend's start), then what rank 0 says until it says stop."""
    from weight_sync.sender import WeightSyncError
    from weight_sync.sharded import RankState, push_sharded
    state = RankState()                   # this rank's engine and delta base, kept between pushes

    def push(version: int) -> None:
        try:
            push_sharded(model, version, state=state)
        except WeightSyncError as e:      # rank 0 decides what a failed push means for the job
            log.warning("rank %d: %s", trainer.rank, e)

    push(first_step)
    while True:
        message = listen()
        if message[0] is Order.TRAIN:
            _, step, tensors, measure = message
            n = tensors["input_ids"].shape[0]
            batch = TrainBatch(**tensors, samples=[None] * n)
            trainer.train_step(batch, keep_logprobs=measure)
            push(step + 1)
            if measure:
                trainer.update_kl(batch)
        elif message[0] is Order.SAVE:
            trainer.save(Path(message[2]), message[1], None)
        else:
            return


@contextlib.contextmanager
def trainer_ranks(job: JobConfig, entry: Callable[[JobConfig], object]):
    """The trainer's process group for the job's world size: yields this process's Lead (rank 0)
    or its rank's (the others). Stops the ranks it started and leaves the group on exit."""
    from platforms import choose_device, dist_backend
    env, k = os.environ, job.trainer.world_size
    backend = dist_backend(choose_device(job.trainer.device))
    timeout = datetime.timedelta(seconds=job.trainer.rank_timeout_s)
    if int(env.get("WORLD_SIZE", "1")) > 1 and "RANK" in env:         # torchrun (or alike) started us all
        world = int(env["WORLD_SIZE"])
        if k not in (1, world):
            raise ConfigError([f"trainer.world_size={k}, but the launcher started {world} processes "
                               f"(WORLD_SIZE={world}); leave it out or make them agree"])
        dist.init_process_group(backend, timeout=timeout)
        try:
            yield Lead(dist.get_rank(), world)
        finally:
            dist.destroy_process_group()
        return
    if k == 1:
        yield Lead(0, 1)
        return
    if job.cluster.kind == "ray":
        from trainer_bridge.fleets.ray_cluster import RayRanks, connect, node_address
        connect(job.cluster)
        master = node_address()
        port = free_port(master)
        ranks = RayRanks(redacted(job), k, master, port, entry)
    else:
        master = "127.0.0.1"
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")        # one machine: the ranks talk over loopback
        ranks = _LocalRanks(job, k)
        port = ranks.port
    told = False
    try:
        formed = _watch(ranks)
        dist.init_process_group(backend, init_method=f"tcp://{master}:{port}", rank=0, world_size=k, timeout=timeout)
        formed.set()
        try:
            yield Lead(0, k)
            told = True
        finally:
            dist.destroy_process_group()
    finally:
        ranks.stop(grace_s=30.0 if told else 3.0)     # after a failure they may be waiting on a collective


class _LocalRanks:
    """Ranks 1..k-1 as processes on this machine, each with cores // k threads and a log of its own."""

    def __init__(self, job: JobConfig, k: int):
        logs = Path(job.run_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        spec = logs / "trainer_job.pkl"
        spec.write_bytes(pickle.dumps(redacted(job)))
        self.port = free_port()
        threads = str(max(1, usable_cores() // k))
        torch.set_num_threads(int(threads))
        self.procs, self.logs = [], []
        for rank in range(1, k):
            self.logs.append(logs / f"trainer_rank{rank}.log")
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(k),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port), "OMP_NUM_THREADS": threads,
                   "RIPTIDE_PARENT_PID": str(os.getpid())}
            with open(self.logs[-1], "ab") as out:
                self.procs.append(subprocess.Popen([sys.executable, "-m", "trainer_bridge.job.rank_entry", str(spec)],
                                                   env=env, stdout=out, stderr=subprocess.STDOUT,
                                                   start_new_session=True))

    def failure(self) -> str | None:
        for rank, (p, path) in enumerate(zip(self.procs, self.logs), start=1):
            if p.poll() is not None:
                tail = path.read_text(errors="replace")[-3000:] if path.exists() else ""
                return f"trainer rank {rank} exited with code {p.returncode} before the ranks met ({path}):\n{tail}"
        return None

    def stop(self, grace_s: float) -> None:
        for p in self.procs:
            try:
                p.wait(grace_s)          # told to stop, they exit on their own
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _watch(ranks) -> threading.Event:
    """Until the group forms, a rank that ends (it could not import, load the model, be placed) ends
    the job with why, instead of rank 0 waiting out the group's timeout."""
    formed = threading.Event()

    def watch():
        while not formed.wait(0.5):
            why = ranks.failure()
            if why:
                print(f"riptide-train: {why}", file=sys.stderr, flush=True)
                os._exit(1)          # nothing else has started yet: the servers start after the group

    threading.Thread(target=watch, name="rank-watch", daemon=True).start()
    return formed
