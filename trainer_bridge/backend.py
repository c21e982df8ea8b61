"""The attach API: Riptide as the rollout backend of any PyTorch trainer.

    backend = RolloutBackend(cfg)          # servers, rollout manager, weight sync (started lazily)
    backend.start(model)                   # initial weights
    for step in range(steps):
        batch = backend.next_batch()       # a TrainBatch: input_ids, attention_mask, loss_mask, behaviour_logprobs, advantages, ...
        ...                                # the trainer's own forward, loss, optimizer
        backend.push_weights(model, version=step + 1)
    backend.close()

The rollout manager runs on its own event loop in a background thread, so generation goes on while
the trainer computes. Every server this object starts, `close()` stops (also on Ctrl-C or SIGTERM
through the context manager, and when the process dies, by the servers' parent-death signal).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inference_server.process import ServerProcess, cpu_share_args
from rollout.agent import RolloutFn, single_turn
from rollout.client import ServerClient
from rollout.config import RolloutConfig
from rollout.data import PromptSource
from rollout.filters import get_filter
from rollout.manager import RolloutManager
from rollout.rewards import get_reward
from rollout.router import Router
from rollout.types import Batch
from trainer_bridge import grpo
from trainer_bridge.config import ServerConfig, TaskConfig, WeightSyncConfig
from trainer_bridge.tasks import DIGIT_TASKS, dataset_items, digit_items

log = logging.getLogger(__name__)


@dataclass
class TrainBatch(Batch):
    """What `next_batch` hands a trainer: the padded groups (Batch; per-token tensors [batch, seq]),
    their GRPO advantages [batch] and the rollout's metrics for this batch."""
    advantages: torch.Tensor = None
    metrics: dict = field(default_factory=dict)

    def rows(self, rows: slice) -> "TrainBatch":
        """A micro-batch: the same fields for rows `rows` (metrics shared)."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name)[rows] for f in dataclasses.fields(self)
                                            if f.name != "metrics"})


@dataclass
class BackendConfig:
    model_path: str
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    normalize_std: bool = True
    seed: int = 0
    log_dir: str = ""


def task_items(task: TaskConfig, seed: int) -> list[dict]:
    if task.name in DIGIT_TASKS:
        return digit_items(task.name, task.num_digits, task.num_prompts, seed)
    if task.name == "dataset":
        return dataset_items(task.path, task.prompt_key, task.answer_key)
    raise ValueError(f"task.name={task.name!r}: use one of {DIGIT_TASKS} or 'dataset'")


class RolloutBackend:
    def __init__(self, cfg: BackendConfig, rollout_fn: RolloutFn = single_turn, items: list[dict] | None = None):
        from transformers import AutoTokenizer
        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        self.data = PromptSource(items if items is not None else task_items(cfg.task, cfg.seed), seed=cfg.seed)
        self.reward = get_reward(cfg.task.reward)
        self.rollout_fn, self.group_filter = rollout_fn, get_filter(cfg.rollout.group_filter)
        self.servers: list[ServerProcess] = []
        self.manager: RolloutManager | None = None
        self.sync = None
        self.version = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-loop", daemon=True)
        self._thread.start()
        self._state: dict | None = None

    # ---- the four calls a trainer makes --------------------------------------------------------
    def start(self, model: torch.nn.Module | None = None, version: int = 0) -> None:
        """Start (or connect to) servers, weight sync and the manager. With `model`, its weights are
        pushed as `version` before the first rollout; without, the servers serve `model_path`."""
        from weight_sync.sender import WeightSync
        first = version - 1 if model is not None else version
        urls = list(self.cfg.server.urls) or self._launch(first)
        self.sync = WeightSync(urls, bucket_bytes=self.cfg.weight_sync.bucket_mb << 20,
                               num_slots=self.cfg.weight_sync.num_slots, timeout_s=self.cfg.weight_sync.timeout_s,
                               allow_partial=self.cfg.weight_sync.allow_partial,
                               api_key=self.cfg.server.api_key or None)
        if model is not None:
            self.sync.push(model, version)
        self.version = version
        router = Router([ServerClient(u, self.cfg.rollout.request_timeout_s, self.cfg.server.api_key or None,
                                      max_connections=self.cfg.rollout.max_inflight) for u in urls])
        self.manager = RolloutManager(self.cfg.rollout, router, self.data, self.tokenizer, self.reward,
                                      self.rollout_fn, self.group_filter)
        if self._state is not None:
            self.manager.load_state_dict(self._state)
        self.manager.trainer_version = version
        if self._state is None:
            self.manager.consumed_groups = 0
        self._call(self.manager.start())

    def next_batch(self, timeout_s: float | None = None) -> TrainBatch:
        """The next batch_size groups as padded tensors, with GRPO advantages and rollout metrics."""
        groups, metrics = self._call(self.manager.next_batch(), timeout_s)
        batch = Batch.from_groups(groups, self.tokenizer.pad_token_id)
        advantages = grpo.group_advantages(batch.rewards, self.cfg.rollout.group_size, self.cfg.normalize_std)
        return TrainBatch(**{f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)},
                          advantages=advantages, metrics=metrics)

    def push_weights(self, model, version: int):
        """Stream `model`'s weights into every server as `version` (two-phase: all flip or none),
        then let the manager apply its in-flight policy. Returns the push's PushStats.

        A push whose commit some server did not confirm has still committed `version` (every server
        had prepared it): the run goes on, and those servers serve their old version, with tokens
        labelled so, until the commit reaches them (`stats.pending` names them)."""
        from weight_sync.sender import CommitIncomplete
        try:
            stats = self.sync.push(model, version, inflight=self.cfg.weight_sync.inflight)
        except CommitIncomplete as e:
            log.warning("%s", e)
            stats = e.stats
        self.version = version
        self._call(self.manager.on_weights_updated(version))
        return stats

    def close(self) -> None:
        try:
            if self.manager is not None and not self.manager.stopping:
                self._call(self.manager.stop(), timeout_s=120)
                self._call(self.manager.router.close(), timeout_s=30)
        finally:
            if self.sync is not None:
                self.sync.close()
                self.sync = None
            for s in self.servers:
                s.stop()
            self.servers = []
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    # ---- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Pause the manager (in-flight samples become partial), read its state, resume."""
        self._call(self.manager.stop())
        state = self.manager.state_dict()
        self._call(self.manager.start())
        return state

    def load_state_dict(self, state: dict) -> None:
        """Before start(): the data position and the unconsumed (partial) groups to resume."""
        self._state = state

    # ---- helpers ---------------------------------------------------------------------------------
    def _launch(self, version: int) -> list[str]:
        s = self.cfg.server
        args = ["--max-running-requests", str(s.max_running_requests), "--context-length", str(s.context_length),
                "--device", s.device, "--dtype", s.dtype, "--seed", str(self.cfg.seed),
                "--weight-version", str(version), "--weight-sync-protocol", self.cfg.weight_sync.protocol]
        if s.api_key:
            args += ["--api-key", s.api_key]
        args += cpu_share_args(s.num_servers)
        log_dir = Path(self.cfg.log_dir or tempfile.mkdtemp(prefix="riptide-servers-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        for i in range(s.num_servers):
            proc = ServerProcess(self.cfg.model_path, args=args, log_path=log_dir / f"server-{i}.log")
            self.servers.append(proc)
        try:
            for proc in self.servers:
                proc.start(timeout=s.start_timeout_s)
        except BaseException:
            for proc in self.servers:
                proc.stop()
            raise
        return [p.url for p in self.servers]

    def _call(self, coro, timeout_s: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def __enter__(self) -> "RolloutBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
