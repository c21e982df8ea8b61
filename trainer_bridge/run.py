"""A whole GRPO job, top to bottom: model, backend, trainer, monitor; then the summary."""
from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from pathlib import Path

import torch

from rollout.config import UpdatePolicy
from trainer_bridge.backend import BackendConfig, RolloutBackend
from trainer_bridge.batch import TrainBatch
from trainer_bridge.config import JobConfig
from trainer_bridge.monitor import Monitor
from trainer_bridge.trainer import GRPOTrainer

log = logging.getLogger(__name__)


def ensure_model(job: JobConfig) -> str:
    path = Path(job.model.path)
    if not (path / "config.json").exists():
        if not job.model.build_tiny:
            raise ValueError(f"model.path={str(path)!r} holds no checkpoint (config.json); point it at one, "
                             f"or set model.build_tiny=true")
        from inference_server.tiny_model import build_tiny_model
        m = job.model
        build_tiny_model(path, hidden=m.hidden, layers=m.layers, heads=m.heads, kv_heads=m.kv_heads,
                         seed=m.seed, tokenizer=m.tokenizer, max_positions=max(2048, job.server.context_length))
    return str(path)


def sync_mode(job: JobConfig) -> JobConfig:
    """Synchronous rollout as the manager's special case: no oversampling, no staleness, so the next
    batch starts only after the new weights land and nothing generates while the trainer trains."""
    rollout = dataclasses.replace(job.rollout, oversample=1.0, max_staleness=0, update_policy=UpdatePolicy["continue"])
    return dataclasses.replace(job, rollout=rollout)


def step_metrics(batch: TrainBatch, train: dict, sync, seconds: dict) -> dict:
    r = batch.metrics
    rewards = batch.rewards
    lengths = [len(s.response_ids) for s in batch.samples]
    out = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
           "reward/accuracy": float((rewards >= 0.999).float().mean()),
           "response/length_mean": sum(lengths) / len(lengths),
           "rollout/tokens_per_s": r["tokens_per_s"], "rollout/samples_per_s": r["samples_per_s"],
           "rollout/inflight": r["inflight"], "rollout/tokens_aborted": r["tokens_aborted"],
           "rollout/tokens_resumed": r["tokens_resumed"], "rollout/tokens_wasted": r["tokens_wasted"],
           "rollout/retries": r["retries"], "rollout/max_staleness": r["max_staleness"],
           "time/wait_for_data_s": seconds["wait"], "time/train_s": seconds["train"],
           "time/weight_sync_s": seconds["sync"], "time/push_s": sync.seconds,
           "sync/bytes": sync.bytes, "sync/gbps": sync.gbps, "sync/stall_s": max(sync.stall_s.values(), default=0.0),
           "sync/egress_bytes": sync.egress_bytes,
           "max_staleness": r["max_staleness"], "staleness_hist": r["staleness_hist"], "drops": r["drops"],
           **{k: v for k, v in r.items() if k.startswith("fleet/")},
           **{f"fleet/tokens_per_s/{url.split('//')[-1]}": v for url, v in r["tokens_per_s_by_server"].items()}}
    out.update({f"train/{k}": v for k, v in train.items()})
    return out


STOP = threading.Event()      # set by the launcher's signal handler; the loop checks it between steps


def stop_on_signal(signum, frame) -> None:
    """Ctrl-C or SIGTERM: stop now, and at the next step if the KeyboardInterrupt raised here is
    lost (one that lands in a __del__ or a callback is printed and dropped)."""
    STOP.set()
    raise KeyboardInterrupt(f"signal {signum}")


def run(job: JobConfig) -> dict:
    job = job.validate()
    if job.mode == "sync":
        job = sync_mode(job)
    random.seed(job.seed)
    torch.manual_seed(job.trainer.seed)
    run_dir = Path(job.run_dir)
    model_path = ensure_model(job)
    from transformers import AutoModelForCausalLM
    ckpt_dir = run_dir / "checkpoints"
    resume = _resume_dir(job, ckpt_dir)
    model = AutoModelForCausalLM.from_pretrained(str(resume or model_path), dtype=torch.float32)
    trainer = GRPOTrainer(model, job.trainer, temperature=job.rollout.temperature)
    backend = RolloutBackend(BackendConfig(model_path=model_path, task=job.task, rollout=job.rollout,
                                           server=job.server, weight_sync=job.weight_sync, cluster=job.cluster,
                                           normalize_std=job.trainer.normalize_std, seed=job.seed,
                                           log_dir=str(run_dir / "logs")))
    first_step = 0
    if resume is not None:
        first_step, rollout_state = trainer.load(resume)
        backend.load_state_dict(rollout_state)
        log.info("resuming from %s at step %d", resume, first_step)
    monitor = Monitor(job.logger, run_dir, dataclasses.asdict(job), job.trainer.steps, first_step)
    rewards, t_start = [], time.perf_counter()
    try:
        backend.start(model, version=first_step)
        for step in range(first_step, job.trainer.steps):
            if STOP.is_set():
                raise KeyboardInterrupt("stop requested by a signal")
            t0 = time.perf_counter()
            batch = backend.next_batch()
            t1 = time.perf_counter()
            train = trainer.train_step(batch)
            t2 = time.perf_counter()
            sync = backend.push_weights(model, version=step + 1)
            t3 = time.perf_counter()
            metrics = step_metrics(batch, train, sync, {"wait": t1 - t0, "train": t2 - t1, "sync": t3 - t2})
            monitor.log(step, metrics, batch.samples)
            rewards.append(metrics["reward/mean"])
            if job.trainer.checkpoint_every and (step + 1) % job.trainer.checkpoint_every == 0:
                trainer.save(ckpt_dir, step + 1, backend.state_dict(), backend.tokenizer)
        trainer.save(ckpt_dir, job.trainer.steps, backend.state_dict(), backend.tokenizer)
    finally:
        backend.close()
        plot = monitor.finish()
    return summary(rewards, job, first_step, time.perf_counter() - t_start, monitor.wandb_dir, plot)


def summary(rewards: list[float], job: JobConfig, first_step: int, seconds: float, wandb_dir: str,
            plot: str) -> dict:
    k = max(1, len(rewards) // 10)
    return {"first_reward": round(sum(rewards[:k]) / k, 4) if rewards else None,
            "last_reward": round(sum(rewards[-k:]) / k, 4) if rewards else None,
            "steps": job.trainer.steps, "first_step": first_step, "seconds": round(seconds, 1),
            "wandb_dir": wandb_dir, "plot": plot}


def _resume_dir(job: JobConfig, ckpt_dir: Path) -> Path | None:
    r = job.trainer.resume
    if not r:
        return None
    if r == "latest":
        marker = ckpt_dir / "latest"
        return ckpt_dir / marker.read_text().strip() if marker.exists() else None
    if not (Path(r) / "trainer_state.pt").exists():
        raise ValueError(f"trainer.resume={r!r} is not a Riptide checkpoint (no trainer_state.pt); "
                         f"use 'latest' or a run_dir/checkpoints/step-N directory")
    return Path(r)
