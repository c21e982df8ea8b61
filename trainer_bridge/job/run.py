"""A whole GRPO job, top to bottom: model, backend, trainer, monitor; then the summary."""
from __future__ import annotations

import dataclasses
import json
import logging
import random
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from rollout.agent import get_rollout_fn
from rollout.config import UpdatePolicy
from rollout.metrics import BatchMetrics
from trainer_bridge.backend import PushInFlight, RolloutBackend, in_background
from trainer_bridge.batch import TrainBatch
from trainer_bridge.config import ConfigError, JobConfig, latest_checkpoint, redacted
from trainer_bridge.job.monitor import Monitor
from trainer_bridge.training import lora
from trainer_bridge.training.ranks import Lead, follow, trainer_ranks
from trainer_bridge.training.trainer import GRPOTrainer

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


def load_model(path: str, lead: Lead):
    """The model from `path` on every rank; (model, from_rank0). A rank whose host cannot read
    `path` (no shared filesystem) builds it from the config rank 0 sends, and every rank then takes
    rank 0's weights once the model is sharded (`from_rank0`)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    readable = (Path(path) / "config.json").is_file()
    if lead.world > 1:
        seen = [None] * lead.world
        torch.distributed.all_gather_object(seen, readable)
        if not all(seen):
            from trainer_bridge.fleets.local import model_files
            box = [model_files(path) if lead.rank == 0 else None]
            torch.distributed.broadcast_object_list(box, src=0)
            if not readable:
                import tempfile
                local = Path(tempfile.mkdtemp(prefix="riptide-rank-model-"))
                for name, data in box[0].items():
                    (local / name).write_bytes(data)
                config = AutoConfig.from_pretrained(local)
                return AutoModelForCausalLM.from_config(config, dtype=torch.float32), True
            return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), True
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), False


def sync_mode(job: JobConfig) -> JobConfig:
    """Synchronous rollout as the manager's special case: no oversampling, no staleness, so the next
    batch starts only after the new weights land and nothing generates while the trainer trains."""
    rollout = dataclasses.replace(job.rollout, oversample=1.0, max_staleness=0, update_policy=UpdatePolicy["continue"])
    return dataclasses.replace(job, rollout=rollout)


def step_metrics(batch: TrainBatch, train: dict, sync, seconds: dict) -> dict:
    r: BatchMetrics = batch.metrics
    rewards = batch.rewards
    lengths = [len(s.response_ids) for s in batch.samples]
    # reward/mean and reward/accuracy: every group the rollout scored since the last step, the ones
    # the filter dropped included (with all_equal, a prompt the policy solves leaves the trained
    # batch, whose reward then says little of how well the policy does); reward/trained_*: the batch
    out = {"reward/mean": r.scored_reward_mean, "reward/accuracy": r.scored_accuracy,
           "reward/trained_mean": float(rewards.mean()), "reward/std": float(rewards.std()),
           "reward/trained_accuracy": float((rewards >= 0.999).float().mean()),
           "response/length_mean": sum(lengths) / len(lengths),
           "rollout/tokens_per_s": r.tokens_per_s, "rollout/samples_per_s": r.samples_per_s,
           "rollout/inflight": r.inflight, "rollout/tokens_aborted": r.tokens_aborted,
           "rollout/tokens_resumed": r.tokens_resumed, "rollout/tokens_wasted": r.tokens_wasted,
           "rollout/prompt_tokens_cached": r.prompt_tokens_cached,
           "rollout/prompt_tokens_old_kv": r.prompt_tokens_old_kv, "rollout/spec_drafted": r.spec_drafted,
           "rollout/spec_accepted": r.spec_accepted,
           "rollout/tokens_per_forward": r.tokens_generated / r.token_forwards if r.token_forwards else 1.0,
           "rollout/retries": r.retries, "rollout/staleness_max": r.staleness_max,
           "rollout/policy_aborts": r.policy_aborts, "rollout/policy_held": r.policy_held,
           "time/wait_for_data_s": seconds["wait"], "time/train_s": seconds["train"],
           "time/weight_sync_s": seconds["sync"], "time/push_s": sync.seconds,
           "sync/bytes": sync.bytes, "sync/gbps": sync.gbps, "sync/stall_s": max(sync.stall_s.values(), default=0.0),
           "sync/egress_bytes": sync.egress_bytes, "sync/wire_fraction": sync.wire_fraction,
           "sync/wire_bytes": sync.wire_bytes, "sync/merge_s": sync.merge_s,
           **({"sync/adapter_fraction": sync.bytes / sync.model_bytes} if sync.model_bytes else {}),
           "sync/delta_servers": sum(m == "delta" for m in sync.modes.values()),
           **({"sync/changed_fraction": sync.changed_fraction} if sync.changed_fraction is not None else {}),
           **{f"sync/egress_bytes/rank{r}": b for r, b in enumerate(sync.egress_by_rank or [])},
           "staleness_max": r.staleness_max, "staleness_hist": r.staleness_hist, "drops": r.drops,
           **({"reward/overlong_penalty": r.overlong_penalty_mean} if r.overlong_penalty_mean is not None else {}),
           "length/bias": r.length_bias, "length/generated_mean": r.generated_mean_len,
           "length/trained_mean": r.trained_mean_len,
           **{f"length/{b}/{k}": v for b, row in r.by_length.items() for k, v in row.items()},
           **r.fleet,
           **{f"fleet/tokens_per_s/{url.split('//')[-1]}": v for url, v in r.tokens_per_s_by_server.items()}}
    out.update({k if k.startswith("rollout_corr/") else f"train/{k}": v for k, v in train.items()})
    return out


STOP = threading.Event()      # set by the launcher's signal handler; the loop checks it between steps
IN_STEP = threading.Event()   # set while the loop runs a step: a first signal then lets the step finish
SIGNAL = {"number": 0}


def stop_on_signal(signum, frame) -> None:
    """Ctrl-C or SIGTERM. Inside a step, the first one lets the step finish; the loop then saves a
    checkpoint and stops. Anywhere else, or a second signal: stop now (KeyboardInterrupt), and at
    the next step too if that exception is lost (one that lands in a __del__ is printed and dropped)."""
    first = not STOP.is_set()
    STOP.set()
    SIGNAL["number"] = signum
    if first and IN_STEP.is_set():
        print(f"\nriptide-train: {signal.Signals(signum).name}: stopping after this step with a checkpoint "
              f"(send it again to stop at once)", file=sys.stderr, flush=True)
        return
    raise KeyboardInterrupt(f"signal {signum}")


class Stopped(KeyboardInterrupt):
    """The run stopped on a signal after saving a checkpoint; `checkpoint` says where."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"stopped by {signal.Signals(signum).name if signum else 'a signal'} after step {step}")


def shares_cores_with_vllm(job: JobConfig) -> bool:
    """The job starts vLLM servers on this machine's CPU, where the trainer runs too."""
    from platforms import platform_of
    server = job.server
    return (server.engine == "vllm" and not server.urls and job.cluster.kind == "local"
            and (server.device == "cpu" or (server.device == "auto" and platform_of("auto").device_type == "cpu")))


def trainer_cores(job: JobConfig) -> int | None:
    """Threads for the trainer while its own servers generate on this CPU (async): the cores they leave
    (each takes cores - 1 by default). Both at full width stall each other at every OpenMP barrier:
    SmolLM2-135M's train step took 66-70 s beside a generating server with 2 threads on 2 cores, where
    it takes ~17 s alone. None: leave torch's setting (OMP_NUM_THREADS given, sync mode, other hosts)."""
    import os
    from platforms import usable_cores
    from trainer_bridge.memory import cpu_servers, local_cpu_servers
    if (os.environ.get("OMP_NUM_THREADS") or job.mode != "async" or not local_cpu_servers(job)
            or not cpu_servers(job.trainer.device)):
        return None
    cores = usable_cores()
    return max(1, cores - job.server.num_servers * max(1, cores - 1))


def run(job: JobConfig) -> dict | None:
    """The job; on k trainer ranks (trainer.world_size) this is rank 0's summary, None on the others."""
    job = job.validate()
    if job.mode == "sync":
        job = sync_mode(job)
    with trainer_ranks(job, run) as lead:
        return _run(job, lead)


def _run(job: JobConfig, lead: Lead) -> dict | None:
    random.seed(job.seed)
    torch.manual_seed(job.trainer.seed)
    if shares_cores_with_vllm(job) and lead.world == 1:
        # vLLM's CPU workers bind their OpenMP threads to cores and keep them busy; a trainer thread
        # on one of those cores holds back every op of the others (a train step 1.3 s against 0.07 s
        # on one thread, on 2 cores)
        torch.set_num_threads(1)
    elif lead.world == 1 and (cores := trainer_cores(job)) is not None:
        torch.set_num_threads(cores)
    run_dir = Path(job.run_dir)
    if lead.rank == 0:
        save_config(job, run_dir)
        ensure_model(job)
    resume = _resume_dir(job, run_dir) if lead.rank == 0 else None
    if lead.world > 1:     # rank 0's run_dir and checkpoint for all (under torchrun each rank's ${now:...}
        box = [job.run_dir, resume]   # may differ; a rank on another host may not see either)
        torch.distributed.broadcast_object_list(box, src=0)
        job, run_dir, resume = dataclasses.replace(job, run_dir=box[0]), Path(box[0]), box[1]
    if resume is not None and lead.rank == 0:
        adapter_run_check(job, resume)
    # an adapter run starts from its base (a checkpoint of one holds the merged weights and the adapter)
    start_from = str(resume if resume is not None and not job.trainer.lora.rank else Path(job.model.path))
    model, from_rank0 = load_model(start_from, lead)
    if job.trainer.lora.rank:
        lc = job.trainer.lora
        model = lora.with_adapters(model, lc.rank, lc.alpha, lc.dropout, lc.target_modules)
        log.info("LoRA rank %d: %.2f%% of the parameters train", lc.rank, 100 * lora.adapter_share(model))
        if resume is not None:
            resume_adapter(model, resume)
    trainer = GRPOTrainer(model, job.trainer, temperature=job.rollout.temperature)     # sharded on k ranks
    if from_rank0:
        trainer.load_weights_from_rank0(start_from)
    if lead.rank != 0:
        follow(model, trainer, trainer.load(resume)[0] if resume is not None else 0)
        return None
    backend = RolloutBackend(job.backend(str(run_dir / "logs")),
                             rollout_fn=get_rollout_fn(job.rollout.rollout_fn))
    first_step = 0
    if resume is not None:
        first_step, rollout_state = trainer.load(resume)
        backend.load_state_dict(rollout_state)
        log.info("resuming from %s at step %d", resume, first_step)
    return _train(job, lead, run_dir, model, trainer, backend, first_step)


def _train(job: JobConfig, lead: Lead, run_dir: Path, model, trainer: GRPOTrainer, backend: RolloutBackend,
           first_step: int) -> dict:
    """Rank 0's steps from `first_step`: a batch, a train step (every rank), a push; checkpoints;
    a signal ends it after the step under way, saved."""
    return Steps(job, lead, run_dir, model, trainer, backend, first_step).run()


class Steps:
    """Rank 0's loop (_train). weight_sync.overlap: a step's push streams while the next step's forward
    and backward passes run (docs/architecture.md, 'The push under the next step')."""

    def __init__(self, job: JobConfig, lead: Lead, run_dir: Path, model, trainer: GRPOTrainer,
                 backend: RolloutBackend, first_step: int):
        self.job, self.lead, self.run_dir, self.model, self.trainer, self.backend = \
            job, lead, run_dir, model, trainer, backend
        self.first_step, self.done, self.saved_step = first_step, first_step, None
        self.monitor = Monitor(job.logger, run_dir, dataclasses.asdict(redacted(job)), job.trainer.steps, first_step)
        self.watch, self.warm = Watch(self.monitor), KlWarmup(job, self.monitor)
        self.rewards: list[float] = []
        self.overlap = job.weight_sync.overlap and job.mode == "async" and lead.world == 1
        self.pending: Pushed | None = None          # the last step, its push still in flight
        self.validation = validation_of(job, backend, self.monitor)
        self.val_metrics: dict = {}                 # the last validation's, logged with the next step

    def save(self, step: int) -> Path:
        ckpt_dir = self.run_dir / "checkpoints"
        self.lead.save(step, ckpt_dir)
        path = self.trainer.save(ckpt_dir, step, self.backend.state_dict(), self.backend.tokenizer)
        self.saved_step = step
        return path

    def run(self) -> dict:
        job, t_start = self.job, time.perf_counter()
        try:
            self.backend.start(self.model, version=self.first_step)
            if self.validation is not None and job.trainer.val_before_train:
                self.validation.start(self.first_step)
            for step in range(self.first_step, job.trainer.steps):
                if STOP.is_set():
                    break
                IN_STEP.set()
                if self.step(step):        # else its push still streams, and the next step runs under it
                    IN_STEP.clear()
            if self.pending is not None:
                self.close(self.pending)
            self.validate_last()
            if STOP.is_set():      # a signal let the step finish: save where it stands, then stop
                path = self.save(self.done) if self.done > self.first_step else latest_checkpoint(self.run_dir)
                self.lead.stop()
                raise Stopped(SIGNAL["number"], self.done, path)
            if self.saved_step != self.done:       # the last step's periodic checkpoint is the final one
                self.save(self.done)
            self.lead.stop()
            note = partial_rollout_note(job, self.monitor.history[-1] if self.monitor.history else {})
            if note:                # the defaults' own behaviour, not a fault: in the run's summary only
                self.monitor.note(note, console=False)
        finally:
            IN_STEP.clear()
            if self.pending is not None:          # failing: the push in flight ends before the backend closes
                try:
                    self.pending.push.wait()
                except BaseException:        # noqa: BLE001  the failure under way is the one to report
                    pass
            # The curves are drawn while the servers and the rollout process stop (mostly waits).
            closed = in_background(self.backend.close, "backend-close")
            try:
                plot = self.monitor.finish()
            finally:
                closed()
        return summary(self.rewards, job, self.first_step, time.perf_counter() - t_start, self.monitor.wandb_dir, plot,
                       self.monitor.history)

    def step(self, step: int) -> bool:
        """One step: a batch, a train step, its push. True when the push is done; False when it
        streams on (self.pending) while the next step runs."""
        job, backend, t0 = self.job, self.backend, time.perf_counter()
        if self.pending is not None and not backend.batch_ready(as_of=step):
            self.close(self.pending)                     # no batch to train yet: the push lands first
        batch = backend.next_batch(as_of=step if self.pending is not None else None)
        t1 = time.perf_counter()
        measure = self.warm.holding
        self.lead.train(step, batch, measure)
        last = self.pending
        waited = last.push.waited_s if last is not None else 0.0
        train = self.trainer.train_step(batch, keep_logprobs=measure,
                                        before_update=(lambda: self.close(last)) if last is not None else None)
        if self.pending is not None:
            self.close(self.pending)
        t2 = time.perf_counter()
        # the wait on the last push inside the step is the push's time (sync), not training's
        seconds = {"wait": t1 - t0, "train": t2 - t1 - (last.push.waited_s - waited if last else 0.0)}
        every = job.trainer.checkpoint_every
        self.collect_validation()                   # the weights it generates with change from here
        if self.overlap and not measure and step + 1 < job.trainer.steps and not STOP.is_set() and not (
                every and (step + 1) % every == 0):
            push = backend.push_in_background(self.model, version=step + 1)
            self.pending = Pushed(step, batch, train, measure, push, {**seconds, "sync": time.perf_counter() - t2})
            return False
        sync = backend.push_weights(self.model, version=step + 1, on_policy=measure)
        self.close(Pushed(step, batch, train, measure, sync, {**seconds, "sync": time.perf_counter() - t2}))
        return True

    def close(self, p: "Pushed") -> None:
        """The step's push done (waited for): its metrics logged, the step counted, a checkpoint due saved."""
        job = self.job
        sync = p.push.wait() if isinstance(p.push, PushInFlight) else p.push
        if p is self.pending:       # (not before: a push that failed, or a wait cut by a signal, is waited for in finally)
            self.pending = None
        seconds = {**p.seconds, "sync": p.seconds["sync"] + getattr(p.push, "waited_s", 0.0)}
        self.warm.after_push(p.measure, p.step, self.trainer, p.batch, p.train)
        metrics = {**step_metrics(p.batch, p.train, sync, seconds), "rollout/on_policy": float(p.measure),
                   "sync/overlapped": float(isinstance(p.push, PushInFlight))}     # under the next step's passes
        metrics.update(self.watch.check(p.step, p.batch, job.rollout.max_new_tokens))
        metrics.update(self.val_metrics)
        self.val_metrics = {}
        self.monitor.log(p.step, metrics, p.batch.samples)
        self.rewards.append(metrics["reward/mean"])
        self.done = p.step + 1
        every_val = job.trainer.val_every
        if self.validation is not None and every_val and self.done % every_val == 0 and self.done < job.trainer.steps:
            self.validation.start(self.done)
        if job.trainer.checkpoint_every and self.done % job.trainer.checkpoint_every == 0 and not STOP.is_set():
            self.save(self.done)


    def collect_validation(self) -> None:
        """Wait for the validation under way (it must end before the next push changes the weights)."""
        if self.validation is not None:
            self.val_metrics.update(self.validation.collect())

    def validate_last(self) -> None:
        """The held-out prompts at the final weights, logged as a row of its own (step = steps done)."""
        if self.validation is None or self.done == self.first_step or STOP.is_set():
            return
        self.collect_validation()
        self.validation.start(self.done)
        self.collect_validation()
        self.monitor.log_validation(self.done, self.val_metrics)
        self.val_metrics = {}


def validation_of(job: JobConfig, backend: RolloutBackend, monitor: Monitor) -> "Validation | None":
    """The job's validation, or None: off (trainer.val_every=0), or no held-out prompts (said once)."""
    if not job.trainer.val_every:
        return None
    from trainer_bridge.backend import val_items
    from trainer_bridge.job.validation import Validation
    items = val_items(job.task, job.seed)
    if not items:
        monitor.note("no validation: the task has no held-out prompts (give task.val_path)")
        return None
    return Validation(backend, items, job.task.reward, job.trainer.val_samples)


@dataclasses.dataclass
class Pushed:
    """A trained step whose push may still stream (`push`: PushInFlight) or is done (its PushStats)."""
    step: int
    batch: TrainBatch
    train: dict
    measure: bool
    push: object
    seconds: dict


class KlWarmup:
    """rollout.on_policy_warmup_kl: the versions are generated on-policy (each push tells the manager
    so) while the trainer's last update moved the policy more than the limit, a KL a token measured
    on the batch it trained (GRPOTrainer.update_kl). The measure is a forward pass after the push,
    while the servers generate the next batch the trainer waits for; the warm-up ends for good at
    the first update under the limit."""

    def __init__(self, job: JobConfig, monitor: Monitor):
        self.limit = job.rollout.on_policy_warmup_kl if job.mode == "async" else 0.0
        self.holding = self.limit > 0
        self.ahead, self.monitor = job.rollout.max_staleness, monitor

    def after_push(self, measure: bool, step: int, trainer: GRPOTrainer, batch: TrainBatch, train: dict) -> None:
        if not measure:
            return
        train["update_kl"] = kl = trainer.update_kl(batch)
        if kl <= self.limit:
            self.holding = False
            self.monitor.note(f"on-policy warm-up ends: step {step}'s update moved the policy {kl:.4g} a token "
                              f"(rollout.on_policy_warmup_kl={self.limit:g}); from version {step + 2} rollout "
                              f"runs up to {self.ahead} ahead")


def partial_rollout_note(job: JobConfig, last: dict) -> str | None:
    """Why partial rollout did not fire, when it did not (abort_furthest aborts only while rollout
    is a batch ahead of the trainer)."""
    if job.mode != "async" or job.rollout.update_policy.value != "abort_furthest" or last.get("rollout/policy_aborts"):
        return None
    held = int(last.get("rollout/policy_held", 0))
    return (f"partial rollout (abort_furthest) aborted nothing: at {held} weight updates with requests in flight, "
            f"rollout was not a batch ahead of the trainer (the trainer waited on generation, and an abort would "
            f"have added a re-prefill to that wait). It fires when generation outpaces training: a larger "
            f"rollout.oversample, more servers, or longer train steps; update_policy=abort_all always aborts.")


def save_config(job: JobConfig, run_dir: Path) -> Path:
    """The resolved config, always in the run dir (wandb or not): what ran, field by field."""
    from omegaconf import OmegaConf
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    fields = dataclasses.asdict(redacted(job))
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(json.loads(json.dumps(fields, default=str)))))
    return path


class Watch:
    """Warnings a run needs to see: every reward zero, or every response cut at max_new_tokens
    while the reward does not rise, for `patience` steps in a row. Loud on the console (once, then
    every `patience` steps) and in wandb (warn/* metrics: the streaks' lengths). A model still
    learning to stop within its budget (the tiny demo's first steps) has every response cut and a
    rising reward: no warning."""

    def __init__(self, monitor: Monitor, patience: int = 10):
        self.patience, self.monitor = patience, monitor
        self.zero = self.cut = 0
        self.cut_rewards: list[float] = []

    def check(self, step: int, batch: TrainBatch, max_new_tokens: int) -> dict:
        rewards = batch.rewards
        self.zero = self.zero + 1 if bool((rewards == 0).all()) else 0
        truncated = [len(s.response_ids) >= max_new_tokens for s in batch.samples]
        self.cut = self.cut + 1 if truncated and all(truncated) else 0
        self.cut_rewards = (self.cut_rewards + [float(rewards.float().mean())])[-self.patience:] if self.cut else []
        out = {"warn/all_rewards_zero_steps": self.zero, "warn/all_truncated_steps": self.cut}
        if self.zero and self.zero % self.patience == 0:
            self.monitor.warn(f"step {step}: every reward has been 0 for {self.zero} steps: nothing to learn from. "
                              f"Check task.reward on a few responses, rollout.max_new_tokens, the chat template "
                              f"(rollout.use_chat_template) and the prompt format")
        half = self.patience // 2
        rising = sum(self.cut_rewards[half:]) / max(1, len(self.cut_rewards) - half) > \
            sum(self.cut_rewards[:half]) / max(1, half) + 0.02
        if self.cut and self.cut % self.patience == 0 and not rising:
            self.monitor.warn(f"step {step}: every response has hit rollout.max_new_tokens={max_new_tokens} for "
                              f"{self.cut} steps: answers are cut off; raise it (and server.context_length)")
        return out


def summary(rewards: list[float], job: JobConfig, first_step: int, seconds: float, wandb_dir: str,
            plot: str, history: list[dict] | None = None) -> dict:
    k = max(1, len(rewards) // 10)
    val = [r["val/accuracy"] for r in history or [] if "val/accuracy" in r]
    return {"first_reward": round(sum(rewards[:k]) / k, 4) if rewards else None,
            "last_reward": round(sum(rewards[-k:]) / k, 4) if rewards else None,
            **({"val_accuracy_first": round(val[0], 4), "val_accuracy_last": round(val[-1], 4)} if val else {}),
            "steps": job.trainer.steps, "first_step": first_step, "seconds": round(seconds, 1),
            "wandb_dir": wandb_dir, "plot": plot}


def adapter_run_check(job: JobConfig, checkpoint: Path) -> None:
    """A checkpoint of an adapter run resumes as one, of the same rank, and a whole model's as a whole
    model's (ConfigError before anything starts)."""
    saved = checkpoint / "adapter" / "adapter_config.json"
    rank = json.loads(saved.read_text()).get("r") if saved.exists() else 0
    if rank and not job.trainer.lora.rank:
        raise ConfigError([f"trainer.resume={checkpoint}: an adapter run's checkpoint (LoRA rank {rank}); "
                           f"resume it with trainer.lora.rank={rank}"])
    if job.trainer.lora.rank and not rank:
        raise ConfigError([f"trainer.resume={checkpoint} with trainer.lora.rank={job.trainer.lora.rank}: the "
                           f"checkpoint holds no adapter (a whole model's run); resume it with trainer.lora.rank=0"])


def resume_adapter(model, checkpoint: Path) -> None:
    """The checkpoint's adapter into `model`'s, once the base `model` was built from is checked to be
    the one the adapter trained on (its digest, kept in the checkpoint)."""
    saved = torch.load(checkpoint / "trainer_state.pt", weights_only=False).get("lora_base_digest")
    ours = lora.base_digest(model) if saved is not None else None
    if saved != ours:
        raise ConfigError([f"trainer.resume={checkpoint}: its adapter trained on another base model than "
                           f"model.path's (base digest {saved[:16]} != {ours[:16]}); "
                           f"set model.path to that run's base"])
    try:
        lora.load_adapter(model, checkpoint / "adapter")
    except ValueError as e:
        raise ConfigError([f"trainer.resume={checkpoint}: {e}"]) from None


def _resume_dir(job: JobConfig, run_dir: Path) -> Path | None:
    """The checkpoint to continue from (validate() has refused resume=latest without one)."""
    r = job.trainer.resume
    if not r:
        return None
    if r in ("latest", "auto"):
        found = latest_checkpoint(run_dir)
        if found is None:
            log.warning("trainer.resume=auto: no checkpoint in %s: starting fresh", run_dir / "checkpoints")
        return found
    return Path(r)
