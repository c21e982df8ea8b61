"""Riptide inside TRL's GRPOTrainer: Riptide's servers generate, TRL trains.

    backend = RolloutBackend(BackendConfig(model_path=...))
    trainer = RiptideGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                                 backend=backend)
    trainer.train()                         # starts the servers, pushes every optimizer step, closes them

Three parts, each usable alone with a stock `GRPOTrainer`:

- `riptide_rollout_func(backend)`: TRL's `rollout_func(prompts, trainer)`. The prompts (already repeated
  num_generations times) are tokenized by the trainer's own tokenizer path, sampled on Riptide's
  servers, and come back as `prompt_ids`, `completion_ids`, `logprobs` (the servers' per-token
  logprobs) and `weight_version` (each completion's oldest token version; any extra key reaches the
  reward functions as a keyword). Under several accelerate processes every rank's prompts go to the
  main process, which alone holds the backend, and each rank gets its own back.
- `RiptideWeightSync(backend)`: a TrainerCallback that pushes the model after every optimizer step as
  version `state.global_step` (two-phase, verified per bucket). A model wrapped by accelerate (DDP) is
  unwrapped; a model sharded with FSDP2 is pushed by every rank, each writing the shard it holds.
- `RiptideGRPOTrainer`: GRPOTrainer with both, plus TRL's importance-sampling correction taken on
  Riptide's logprobs. TRL computes that correction (the `vllm_importance_sampling_*` arguments: mode,
  clip) only on its vLLM path; here the trainer takes that path for the correction alone and never
  builds a vLLM client.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import torch

try:
    from trl import GRPOTrainer
except ImportError as e:                         # the extra is not installed
    raise ImportError(f"trainer_bridge.integrations.trl needs TRL: pip install 'riptide[trl]' ({e})") from e
from transformers import TrainerCallback

from trainer_bridge.backend import RolloutBackend

log = logging.getLogger(__name__)


def sampling_params_of(args) -> dict:
    """Riptide's sampling parameters for a GRPOConfig; what Riptide's servers cannot do is refused here."""
    if getattr(args, "repetition_penalty", 1.0) not in (None, 1.0):
        raise ValueError(f"repetition_penalty={args.repetition_penalty}: Riptide's servers sample without a "
                         f"repetition penalty; leave it at 1.0")
    top_k = getattr(args, "top_k", None)
    params = {"max_new_tokens": args.max_completion_length, "temperature": args.temperature,
              "top_p": args.top_p, "top_k": top_k if top_k and top_k > 0 else -1,
              "min_p": getattr(args, "min_p", None) or 0.0}
    if getattr(args, "generation_kwargs", None):
        params.update(args.generation_kwargs)
    return params


def tokenize_prompts(trainer, prompts: list) -> list[list[int]]:
    """The trainer's own tokenization of its prompts (chat template, tools, template kwargs), so the
    ids Riptide samples from are the ids TRL trains on."""
    prompt_ids, images, fields = trainer._tokenize_prompts(prompts)
    if images is not None or fields:
        raise ValueError("multimodal prompts: Riptide's servers generate from text only")
    return [list(map(int, ids)) for ids in prompt_ids]


def riptide_rollout_func(backend: RolloutBackend | None) -> Callable[[list, Any], dict]:
    """`backend` on the main process; None on the others, whose prompts the main process samples."""
    def rollout_func(prompts: list, trainer) -> dict:
        prompt_ids = tokenize_prompts(trainer, prompts)
        gens = on_main_process(trainer.accelerator, prompt_ids,
                               lambda ids: backend.generate(ids, sampling_params_of(trainer.args)))
        return {"prompt_ids": prompt_ids,
                "completion_ids": [g.output_ids for g in gens],
                "logprobs": [g.logprobs for g in gens],
                "weight_version": [min(g.versions, default=-1) for g in gens]}
    return rollout_func


def on_main_process(accelerator, items: list, fn: Callable[[list], list]) -> list:
    """fn over every rank's items, run on the main process; each rank gets its own results back."""
    if accelerator is None or accelerator.num_processes == 1:
        return fn(items)
    from accelerate.utils import broadcast_object_list, gather_object
    counts = gather_object([len(items)])
    everything = gather_object(items)
    out = [fn(everything) if accelerator.is_main_process else None]
    results = broadcast_object_list(out, from_process=0)[0]
    start = sum(counts[:accelerator.process_index])
    return results[start:start + len(items)]


def unwrap(model):
    """The model the weights live in: accelerate's DDP wrapper and torch.compile's are taken off;
    an FSDP2 module is the model itself (its parameters are DTensors)."""
    while hasattr(model, "module") and not hasattr(model, "config"):
        model = model.module
    return getattr(model, "_orig_mod", model)


class RiptideWeightSync(TrainerCallback):
    """Pushes the trained weights into Riptide's servers after every optimizer step, as version
    `state.global_step`; starts the backend at train begin (its first push is the model as it
    starts, version global_step) and closes it at train end when `close_at_end`."""

    def __init__(self, backend: RolloutBackend | None, close_at_end: bool = True, manager: bool = False):
        self.backend, self.close_at_end, self.manager = backend, close_at_end, manager
        self.sharded = None      # an FSDP2 rank other than the backend's: its sharded.RankState, from its first push

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from weight_sync import sharded
        if self.backend is not None and self.backend.sync is None:
            self.backend.start(unwrap(model), version=state.global_step, manager=self.manager)
        elif self.backend is None and sharded.is_sharded(unwrap(model)):
            self.push_shard(unwrap(model), state.global_step)    # the main rank's first push, sharded

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.push(unwrap(model), state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.backend is not None and self.close_at_end:
            self.backend.close()

    def push(self, model, version: int) -> None:
        from weight_sync import sharded
        if self.backend is not None:
            if self.backend.version != version:
                self.backend.push_weights(model, version)
        elif sharded.is_sharded(model):          # an FSDP2 rank other than the backend's: its shard
            self.push_shard(model, version)

    def push_shard(self, model, version: int) -> None:
        """This rank's part of a sharded push (its RankState kept from one push to the next)."""
        from weight_sync import sharded
        self.sharded = self.sharded or sharded.RankState()
        sharded.push_sharded(model, version, state=self.sharded)


class _NoVLLM:
    """What the trainer finds where its vLLM client would be: the weights reach the servers through
    RiptideWeightSync, so there is nothing to sync before generating."""

    def sync_weights(self) -> None:
        pass


class RiptideGRPOTrainer(GRPOTrainer):
    """A TRL GRPOTrainer that generates on Riptide (`backend` on the main process, None on the
    others), pushes after each optimizer step, and corrects for the servers' sampling policy with
    TRL's importance sampling on Riptide's logprobs (`args.vllm_importance_sampling_correction`, on
    by default; its mode and clip are TRL's `vllm_importance_sampling_*` arguments)."""

    def __init__(self, *args, backend: RolloutBackend | None, close_at_end: bool = True, **kwargs):
        if kwargs.get("rollout_func") is not None:
            raise ValueError("RiptideGRPOTrainer brings its own rollout_func (Riptide's servers): pass none, "
                             "or give riptide_rollout_func to a plain GRPOTrainer")
        train_args = kwargs.get("args", args[2] if len(args) > 2 else None)
        if getattr(train_args, "use_vllm", False):
            raise ValueError("use_vllm=True: RiptideGRPOTrainer generates on Riptide's servers, not vLLM; "
                             "set use_vllm=False")
        if train_args is not None:
            sampling_params_of(train_args)       # what the servers cannot do fails before anything starts
        self.riptide = backend
        super().__init__(*args, rollout_func=riptide_rollout_func(backend), **kwargs)
        self.add_callback(RiptideWeightSync(backend, close_at_end=close_at_end))
        # TRL's importance-sampling correction lives on its vLLM path: the trainer takes that path for
        # the correction alone, with nothing behind the client (the rollout_func generates, the
        # callback pushes).
        self.use_vllm = True
        self.vllm_mode = "server"
        self.vllm_generation = _NoVLLM()
        self._last_loaded_step = -1


# ---- TRL's async GRPO (trl.experimental.async_grpo): its two protocols over Riptide --------------
class RiptideWeightTransfer:
    """TRL's WeightTransferProtocol over Riptide's weight sync. `init_weight_transfer` starts the
    backend (servers, weight sync, the rollout manager); each `send_weights` is one transactional
    push, verified per bucket and committed on every server or none, as version k for the k-th send
    (the trainer's `model_version` after it). `pause` and `resume` do nothing: a push needs no pause,
    requests in flight go on and record per token which version sampled it."""

    def __init__(self, backend: RolloutBackend, close_at_end: bool = True):
        self.backend, self.close_at_end = backend, close_at_end
        self.version = 0

    def init_weight_transfer(self) -> None:
        if self.backend.sync is None:
            self.backend.start(version=self.version)

    def pause(self) -> None:
        pass

    def send_weights(self, iterator) -> None:
        weights = {name: tensor for name, tensor in iterator}
        self.version += 1
        self.backend.push_weights(weights, self.version)

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        if self.close_at_end:
            self.backend.close()


class RiptideRolloutWorker:
    """TRL's RolloutWorkerProtocol over Riptide's async rollout manager: a thread moves each batch
    the manager completes (`next_batch`: groups scored by the backend's task reward, GRPO advantages,
    per-token versions) into `rollout_buffer` as TRL's RolloutSamples, one per completion, tagged with
    the oldest weight version among its tokens. The manager's own bounds (max_staleness, its
    update_policy) apply before TRL's; TRL drops what is staler than its max_staleness."""

    def __init__(self, backend: RolloutBackend, queue_maxsize: int = 0, batch_timeout_s: float | None = None,
                 poll_s: float = 0.02):
        import queue
        self.backend, self.poll_s = backend, poll_s
        self.rollout_buffer = queue.Queue(maxsize=queue_maxsize)
        self.metrics_queue = queue.Queue()
        self.model_version = 0
        self.batch_timeout_s = batch_timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last_put = time.monotonic()
        self._groups = 0

    def start(self) -> None:
        if self.backend.rollout is None:
            raise RuntimeError("RiptideRolloutWorker.start before the backend started: pass a RiptideWeightTransfer "
                               "(its init_weight_transfer starts it) or call backend.start() first")
        self._thread = threading.Thread(target=self._run, name="riptide-rollout-worker", daemon=True)
        self._thread.start()

    def update_model_version(self, model_version: int) -> None:
        self.model_version = model_version

    def check_health(self, stale_after_s: float) -> None:
        if self._error is not None:
            raise RuntimeError(f"Riptide's rollout worker stopped: {self._error!r}") from self._error
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            raise RuntimeError("Riptide's rollout worker thread ended")
        idle = time.monotonic() - self._last_put
        if idle > stale_after_s:
            raise RuntimeError(f"Riptide's rollout worker put no sample for {idle:.0f} s (stale after {stale_after_s} s)")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        import queue
        try:
            while not self._stop.is_set():
                if not self.backend.batch_ready():       # a waiting next_batch would hold up the trainer's push
                    self._stop.wait(self.poll_s)
                    continue
                batch = self.backend.next_batch(timeout_s=self.batch_timeout_s)
                samples = rollout_samples(batch, self.backend.tokenizer, self._groups)
                self._groups += int(batch.group_index.max()) + 1
                for sample in samples:
                    while not self._stop.is_set():
                        try:
                            self.rollout_buffer.put(sample, timeout=0.5)
                            break
                        except queue.Full:
                            continue
                    self._last_put = time.monotonic()
                self.metrics_queue.put({f"riptide/{k}": float(v) for k, v in batch.metrics.items()
                                        if isinstance(v, (int, float)) and not isinstance(v, bool)})
        except BaseException as e:               # the trainer sees it through check_health
            if not self._stop.is_set():
                log.exception("Riptide's rollout worker failed")
                self._error = e


def rollout_samples(batch, tokenizer, first_group: int = 0) -> list:
    """A TrainBatch as TRL RolloutSamples: one per completion, prompt and completion as text,
    unpadded ids with the completion's loss mask and behaviour logprobs (0 on the prompt); group ids
    count on from `first_group`."""
    import numpy as np
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample
    out = []
    for row, s in enumerate(batch.samples):
        n = len(s.input_ids)
        versions = [v for v, m in zip(batch.versions[row, :n].tolist(), batch.loss_mask[row, :n].tolist()) if m]
        reward = float(batch.rewards[row])
        out.append(RolloutSample(
            prompt=[{"role": "user", "content": tokenizer.decode(s.prompt_ids)}],
            completion=[{"role": "assistant", "content": tokenizer.decode(s.response_ids, skip_special_tokens=True)}],
            input_ids=np.asarray(s.input_ids, dtype=np.int64),
            completion_mask=batch.loss_mask[row, :n].to(torch.int64).numpy(),
            old_log_probs=batch.behaviour_logprobs[row, :n].numpy().astype(np.float32),
            advantage=float(batch.advantages[row]),
            model_version=min(versions, default=0),
            group_id=first_group + int(batch.group_index[row]),
            metrics={"reward": reward},
            enqueued_at=time.time()))
    return out
