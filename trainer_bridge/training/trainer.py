"""The built-in GRPO trainer: PyTorch + transformers, on the same attach API an outside trainer uses.

One step: take a batch from the backend, recompute logprobs with the current weights (micro-batches of
up to micro_batch_size rows and max_tokens_per_micro_batch tokens, rows of like lengths together;
gradient accumulation; the LM head's logits a chunk of positions at a time, lm_head.py), clipped
policy-gradient loss corrected for the server's behaviour logprobs
(`trainer.off_policy`: PPO's clip against the behaviour policy by default; grpo.py), clip gradients,
AdamW, push the new weights as version step + 1.

On k ranks of a torch.distributed job (trainer.world_size=k, trainer_bridge/training/ranks.py) the model is
sharded with FSDP2 (`fully_shard` on each decoder layer, then the root) and every rank gets the same
batch: each mini-batch's rows are dealt round the ranks, every rank runs the same number of micro-
batches (a rank short of rows runs one with no weight, as FSDP's collectives need every rank), the
loss of each is weighted by its share of the whole mini-batch's tokens, and FSDP2 reduce-scatters
the gradients once per mini-batch. The update equals the one-rank update on the same batch, up to
the order of float sums. Checkpoints hold the sharded state (torch.distributed.checkpoint, any
number of ranks can resume it) next to Hugging Face weights for serving.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from platforms import platform_of, rank_device
from trainer_bridge.training import grpo, lm_head, lora, packing
from trainer_bridge.training.agreement import Agreement
from trainer_bridge.batch import TrainBatch
from trainer_bridge.config import TrainerConfig, auto_lr

log = logging.getLogger("riptide.trainer")


def lr_at(cfg: TrainerConfig, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based): linear warm-up over lr_warmup_steps, then
    constant, or a cosine / linear decay that reaches lr * min_lr_ratio at the last step. A function
    of the step alone, so a resumed run continues the schedule from its checkpoint's step."""
    warmup = cfg.lr_warmup_steps
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - warmup) / max(1, cfg.steps - 1 - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_schedule == "cosine" else 1 - progress
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape)


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 over the job's ranks: each decoder layer (the classes a Hugging Face model names in
    `_no_split_modules`) its own unit, then the root (embeddings, norm, head). In place."""
    from torch.distributed.fsdp import fully_shard
    units = set(getattr(model, "_no_split_modules", None) or ())
    for module in [m for m in model.modules() if type(m).__name__ in units]:
        fully_shard(module)
    fully_shard(model)
    return model


def checkpoint_activations(model: torch.nn.Module) -> None:
    """trainer.gradient_checkpointing: each decoder layer keeps only its input for backward and
    recomputes the rest there (non-reentrant, the kind FSDP2 supports); no KV cache in training."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):          # transformers >= 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise ValueError(f"trainer.gradient_checkpointing=true: {type(model).__name__} has no "
                         "gradient_checkpointing_enable (a Hugging Face model has one); set it to false")
    model.config.use_cache = False


class GRPOTrainer:
    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig, temperature: float = 1.0):
        if cfg.lr == 0:          # auto, given no job to say whether the model was built from scratch
            cfg = dataclasses.replace(cfg, lr=auto_lr(from_scratch=False, lora=cfg.lora.rank > 0))
        self.cfg = cfg
        sharded = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
        self.device = rank_device(cfg.device, int(os.environ.get("LOCAL_RANK", 0)))
        model = model.to(self.device)
        self.reference = None
        if cfg.kl_coef > 0:
            import copy
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        if cfg.gradient_checkpointing:
            checkpoint_activations(model)
        if sharded:
            shard(model)
            if self.reference is not None:
                shard(self.reference)
        self.model = model.train()
        self._lora_base_digest: str | None = None
        self.temperature = temperature if temperature > 0 else 1.0
        # Fused AdamW where torch has it (CPU and CUDA): one kernel over every parameter; on CPU it
        # took 7 ms a step against 32 ms for the per-tensor loop (6.5M parameters, one thread).
        # only what trains: with LoRA adapters (training/lora.py) the frozen base has no optimizer state
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                           betas=tuple(cfg.betas),
                                           weight_decay=cfg.weight_decay,
                                           fused=True if platform_of(self.device).fused_adamw else None)
        self.step_count = 0
        self._packing: bool | None = None     # packed forward passes: None until the first one is checked
        self._before: torch.Tensor | None = None      # train_step(keep_logprobs): the logprobs before it
        self._agreement: Agreement | None = None      # open from a step's start to its first optimizer step

    def _shares(self, rows: torch.Tensor, lengths: torch.Tensor) -> list[tuple[torch.Tensor, bool]]:
        """This rank's micro-batches of `rows` (rows dealt round the ranks, then grouped by their
        `lengths` [batch], up to micro_batch_size rows and max_tokens_per_micro_batch tokens), as
        many on every rank; each with whether it is real (False: a stand-in row the rank runs with
        no weight)."""
        mine = rows[self.rank::self.world]
        groups = packing.micro_batches(lengths[mine].tolist(), self.cfg.micro_batch_size,
                                       self.cfg.max_tokens_per_micro_batch)
        count = int(self._max_over_ranks(len(groups)))
        return [(mine[g], True) for g in groups] + [(rows[:1], False)] * (count - len(groups))

    def _sync_gradients(self, last: bool) -> None:
        """FSDP2: reduce-scatter the gradients after a mini-batch's last micro-batch only."""
        if self.world > 1:
            self.model.set_requires_gradient_sync(last)

    def _all_ranks_sum(self, values: dict[str, float]) -> dict[str, float]:
        if self.world == 1:
            return values
        keys = sorted(values)
        total = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return dict(zip(keys, total.tolist()))

    def _autocast(self):
        enabled = self.cfg.dtype == "bfloat16"        # CPU too: AMX / avx512_bf16 matmuls (bench/real_model.py)
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def train_step(self, batch: TrainBatch, keep_logprobs: bool = False,
                   before_update: Callable[[], object] | None = None) -> dict:
        """One trainer step over the batch: `ppo_epochs` passes, each in mini-batches of
        `ppo_mini_batch_size` rows (one optimizer step each); returns the step's training metrics,
        token-weighted means over every update. `keep_logprobs`: keep the logprobs of the weights
        before the step, for `update_kl` (every rank, when sharded). `before_update`: called once,
        before the first optimizer step changes the weights (a push of them still in flight waits
        there)."""
        t0 = time.perf_counter()
        self.model.train()
        n = batch.input_ids.shape[0]
        size = self.cfg.ppo_mini_batch_size or n
        updates = self.cfg.ppo_epochs * math.ceil(n / size)
        # The proximal ("old") policy: the weights before this step. With one update it is the
        # current policy itself (detached), so no extra forward pass.
        proximal = self._logprobs(batch) if updates > 1 else None
        before = proximal if proximal is not None or not keep_logprobs else \
            torch.zeros(n, batch.input_ids.shape[1] - 1, device=self.device)
        lr = lr_at(self.cfg, self.step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        sums: dict[str, float] = {}
        norms = []
        self._agreement = Agreement()       # the server's logprobs against these weights', before they change
        if proximal is not None:
            self._agreement.add(proximal, batch.behaviour_logprobs[:, 1:].to(self.device), self._own_tokens(batch))
        lengths = batch.attention_mask.sum(1)                                # [batch] tokens of each row
        generator = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.step_count)
        for epoch in range(self.cfg.ppo_epochs):
            order = torch.randperm(n, generator=generator) if updates > 1 else torch.arange(n)
            for start in range(0, n, size):
                self.optimizer.zero_grad(set_to_none=True)
                keep = before if before is not proximal and epoch == 0 else None
                self._gradients(batch, order[start:start + size], lengths, proximal, keep, sums, 1.0 / updates)
                norm = torch.nn.utils.clip_grad_norm_(
                    self.model.parameters(), self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf)
                norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
                if before_update is not None:
                    before_update, call = None, before_update
                    call()
                self.optimizer.step()
                if self._agreement is not None:
                    agreement, self._agreement = self._agreement.metrics(self.world, self.device), None
        sums = self._all_ranks_sum(sums)
        if before is not None and before is not proximal and self.world > 1:
            dist.all_reduce(before)              # each rank filled in its own rows
        self._before = before if keep_logprobs else None
        self.step_count += 1
        seconds = time.perf_counter() - t0
        return {**sums, **agreement, "grad_norm": sum(norms) / len(norms), "lr": lr, "train_seconds": seconds,
                "optimizer_steps": updates,
                "trainer_tokens_per_s": float(batch.attention_mask.sum()) * self.cfg.ppo_epochs / seconds}

    def _gradients(self, batch: TrainBatch, rows: torch.Tensor, lengths: torch.Tensor, proximal: torch.Tensor | None,
                   before: torch.Tensor | None, sums: dict[str, float], scale: float) -> None:
        """Accumulate one mini-batch's gradients (`rows`), micro-batch by micro-batch; its metrics
        added to `sums` (x `scale`, token-weighted); `before`: filled in with the rows' logprobs."""
        tokens = float(batch.loss_mask[rows].sum())          # the whole mini-batch's, on every rank
        shares = self._shares(rows, lengths)
        for i, (part, real) in enumerate(shares):
            prox = proximal[part.to(proximal.device)] if proximal is not None else None
            loss, metrics, weight = self._micro_batch(batch.rows(part), tokens, prox)
            if before is not None and real:
                before[part.to(self.device)] = self._micro_logprobs
            if not real:
                loss, weight = loss * 0.0, 0.0
            self._sync_gradients(i == len(shares) - 1)
            # FSDP2 averages gradients over the ranks; the weights already add up to the mini-batch
            (loss * self.world).backward()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * weight * scale

    def update_kl(self, batch: TrainBatch) -> float:
        """How far the last train_step (called with keep_logprobs) moved the policy on `batch`, the
        batch it trained: the mean k3 KL a response token between the weights before and after
        (the same measure as train/logprob_kl_k3, the behaviour KL of a stale batch). One forward
        pass without gradients, on every rank when sharded."""
        if getattr(self, "_before", None) is None:
            raise RuntimeError("update_kl() needs the last train_step(batch, keep_logprobs=True)")
        after = self._logprobs(batch)
        mask = batch.loss_mask[:, 1:].to(self.device)
        before, self._before = self._before, None
        return float(grpo.logprob_mismatch(after, before, mask)["kl_k3"])

    @torch.no_grad()
    def _logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """The current weights' logprob of every token, [batch, seq-1], in micro-batches (on k
        ranks each computes its share of the rows, and a sum over the ranks fills in the rest)."""
        n, length = batch.input_ids.shape
        out = torch.zeros(n, length - 1, device=self.device)
        for part, real in self._shares(torch.arange(n), batch.attention_mask.sum(1)):
            mb = batch.rows(part)
            logprobs, _ = self._token_logprobs(self.model, mb, entropy=False)
            if real:
                out[part.to(self.device)] = logprobs.float()
        if self.world > 1:
            dist.all_reduce(out)
        return out

    def _token_logprobs(self, model, mb: TrainBatch, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`model`'s logprob of each next token of the micro-batch (and its entropy), [mb, seq-1], 0
        past each row's end: one forward pass over the sequences packed end to end
        (trainer.pack_length; packing.py), or over the right-padded rows (pack_length 0, or a model
        the first packed pass showed to attend across sequences)."""
        ids, attention = mb.input_ids.to(self.device), mb.attention_mask.to(self.device)
        # only where the next token is a response token: the loss reads nothing else, and the head over
        # the vocabulary was ~30% of a real model's step (SmolLM2-135M, prompts half the tokens)
        want = mb.loss_mask[:, 1:].to(self.device).bool()            # [mb, seq-1]
        if self._packing is False or self.cfg.pack_length == 0:
            return self._padded_logprobs(model, ids, attention, entropy, want)
        packed = packing.pack(ids, attention, self.cfg.pack_length)
        inputs = dict(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
        keep = packed.keep & want
        logprobs, ent = self._forward_logprobs(model, inputs, packed.source[want[packed.keep]], keep, entropy)
        if self._packing is None and self._any_rank(packed.bins < len(ids)):     # sequences shared a row
            self._packing = self._packing_holds(model, ids, attention, logprobs.detach(), keep)
            if not self._packing:
                return self._token_logprobs(model, mb, entropy)
        return logprobs, ent

    def _padded_logprobs(self, model, ids, attention, entropy: bool,
                         want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        keep = attention[:, 1:].bool() & want              # [mb, seq-1]: token t+1 exists (right-padded rows)
        index = keep.flatten().nonzero().squeeze(1)
        return self._forward_logprobs(model, dict(input_ids=ids, attention_mask=attention), index, keep, entropy)

    def _forward_logprobs(self, model, inputs: dict, index: torch.Tensor, keep: torch.Tensor,
                          entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward pass of `model` on `inputs`: the next token's logprob (and entropy) at `index`
        [kept] (flat into [rows, width - 1] of inputs' input_ids), laid out as `keep` [mb, seq-1]
        (0 elsewhere). The head's logits a chunk of trainer.logits_chunk_tokens at a time (lm_head.py),
        or whole for a model without a head to call apart (or logits_chunk_tokens 0)."""
        entropy_grad = entropy and self.cfg.entropy_coef > 0
        head = lm_head.output_head(model) if self.cfg.logits_chunk_tokens > 0 else None
        if head is None:
            values = self._full_logits(model, inputs, entropy, entropy_grad).flatten(0, 1)[index]
        else:
            values = self._head_chunks(model, head, inputs, index, entropy, entropy_grad)
        lay_out = [keep.new_zeros(keep.shape, dtype=values.dtype).masked_scatter(keep, v) for v in values.unbind(-1)]
        return lay_out[0], (lay_out[1] if entropy else None)

    def _head_chunks(self, model, head, inputs: dict, index: torch.Tensor, entropy: bool,
                     entropy_grad: bool) -> torch.Tensor:
        """[kept, 1 + entropy]: the model's own forward, its head swapped for lm_head's chunks."""
        forward = lm_head.positions_forward(head, inputs["input_ids"], index, self.temperature, entropy,
                                            entropy_grad, self.cfg.logits_chunk_tokens)
        with self._autocast(), lm_head.head_replaced(head, forward):
            values = model(**inputs).logits
        if values.shape != (len(index), 1 + entropy):
            raise RuntimeError(f"{type(model).__name__}'s forward gave logits of shape {tuple(values.shape)}, not "
                               f"its output head's ({len(index)}, {1 + entropy}): it does not end in "
                               "get_output_embeddings(); set trainer.logits_chunk_tokens=0 (whole logits)")
        return values

    def _full_logits(self, model, inputs: dict, entropy: bool, entropy_grad: bool) -> torch.Tensor:
        """[rows, width - 1, 1 + entropy] from the whole [rows, width, vocab] logits at once."""
        with self._autocast():
            logits = model(**inputs).logits
        logprobs, ent = grpo.sequence_logprobs_and_entropy(logits, inputs["input_ids"], self.temperature, entropy,
                                                           entropy_grad)
        return torch.stack([logprobs, ent] if entropy else [logprobs], -1)

    def _max_over_ranks(self, value: float) -> float:
        if self.world == 1:
            return value
        box = torch.tensor([float(value)], device=self.device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return float(box.item())

    def _any_rank(self, flag: bool) -> bool:
        return self._max_over_ranks(float(flag)) > 0

    def _packing_holds(self, model, ids, attention, packed_logprobs, keep: torch.Tensor) -> bool:
        """Once, on the first micro-batch: do the packed logprobs match the padded rows'? A model (or
        a transformers too old to read packed position ids) that attends across sequences does
        not, and then the trainer pads from here on, saying so. Every rank runs this same extra
        pass on its first micro-batch (FSDP2's collectives stay in step)."""
        with torch.no_grad():
            padded, _ = self._padded_logprobs(model, ids, attention, False, keep)
        gaps = (padded - packed_logprobs).abs()[keep]
        exact = self.cfg.dtype == "float32"
        # float32: the largest gap (rounding only, ~1e-6); bfloat16 rounds more, so the mean gap
        gap = float(gaps.max() if exact else gaps.mean()) if gaps.numel() else 0.0
        if self._any_rank(gap > (1e-3 if exact else 2e-2)):          # every rank decides the same
            log.warning("trainer.pack_length=%d: packed sequences gave logprobs up to %.3g off the padded rows' "
                        "(%s attends across sequences: needs transformers >= 4.54 reading position_ids); "
                        "training on padded rows instead (set trainer.pack_length=0 to skip this check)",
                        self.cfg.pack_length, gap, type(model).__name__)
            return False
        return True

    def _micro_batch(self, mb: TrainBatch, batch_tokens: float, proximal: torch.Tensor | None = None):
        """Loss of one micro-batch, scaled so that gradients add up to the mini-batch's loss."""
        mask = mb.loss_mask[:, 1:].to(self.device)                     # [mb, seq-1]: token t+1 given <= t
        behaviour = mb.behaviour_logprobs[:, 1:].to(self.device)
        advantages = mb.advantages.to(self.device)                      # [mb]
        logprobs, entropy = self._token_logprobs(self.model, mb, entropy=True)   # [mb, seq-1] each
        self._micro_logprobs = logprobs.detach()
        if proximal is None and self._agreement is not None:        # before the step's first optimizer step
            self._agreement.add(logprobs, behaviour, self._own_tokens(mb))
        proximal = logprobs.detach() if proximal is None else proximal
        loss, metrics = grpo.policy_loss(
            logprobs, proximal, advantages, mask, clip_low=self.cfg.clip_low, clip_high=self.cfg.clip_high,
            agg=self.cfg.loss_agg, behaviour_logprobs=behaviour if self.cfg.tis_cap > 0 else None,
            tis_cap=self.cfg.tis_cap if self.cfg.tis_cap > 0 else None, off_policy=self.cfg.off_policy,
            is_band_low=self.cfg.is_band_low)
        entropy = grpo.aggregate(entropy, mask, self.cfg.loss_agg)
        if self.cfg.entropy_coef > 0:
            loss = loss - self.cfg.entropy_coef * entropy
        metrics = {**metrics, "entropy": entropy.detach()}
        if self.reference is not None:
            with torch.no_grad():
                ref, _ = self._token_logprobs(self.reference, mb, entropy=False)
            kl = grpo.aggregate(grpo.kl_k3(logprobs, ref), mask, self.cfg.loss_agg)
            loss = loss + self.cfg.kl_coef * kl
            metrics = {**metrics, "kl_ref": kl.detach()}
        mismatch = grpo.logprob_mismatch(logprobs.detach(), behaviour, mask)
        metrics = {**metrics, **{f"logprob_{k}": v for k, v in mismatch.items()}, "loss": loss.detach()}
        weight = float(mask.sum()) / max(batch_tokens, 1.0)
        return loss * weight, metrics, weight

    def _own_tokens(self, batch: TrainBatch) -> torch.Tensor:
        """[rows, seq-1]: response tokens that the trainer's present weights (version = steps taken) sampled."""
        versions = batch.versions[:, 1:].to(self.device)
        return batch.loss_mask[:, 1:].to(self.device).bool() & (versions == self.step_count)

    # ---- checkpoints -----------------------------------------------------------------------------
    def save(self, directory: Path, step: int, rollout_state: dict | None, tokenizer=None) -> Path:
        """A checkpoint as `directory/step-N` (every rank calls it when the trainer is sharded; rank 0
        passes the rollout state): Hugging Face weights (what a server or a fresh run loads), the
        optimizer and the step; with k ranks the model and optimizer as sharded state under
        `sharded/`, from which any number of ranks resumes, or, when the ranks do not share a
        filesystem, the optimizer gathered to rank 0 too. `latest` names it once it is whole."""
        directory = Path(directory) / f"step-{step:06d}"
        state = {"step": step, "world_size": self.world,
                 "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
        directory.mkdir(parents=True, exist_ok=True)
        if self.world == 1 and lora.is_adapted(self.model):
            # the merged weights as a Hugging Face folder (what a server or a fresh run loads), the adapter apart
            self.model.get_base_model().save_pretrained(directory, state_dict=lora.merged_weights(self.model))
            self.model.save_pretrained(directory / "adapter")
            state["optimizer"] = self.optimizer.state_dict()
            state["lora_base_digest"] = self.lora_base_digest()
        elif self.world == 1:
            self.model.save_pretrained(directory)
            state["optimizer"] = self.optimizer.state_dict()
        elif self._all_see(directory):
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory / "sharded"))
            self._save_full_weights(directory)
        else:                                   # no shared filesystem: everything gathered to rank 0
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
            optim = get_optimizer_state_dict(self.model, self.optimizer,
                                             options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if self.rank == 0:
                state["optimizer_by_name"] = optim
            del optim
            self._save_full_weights(directory)
        if self.rank == 0:
            if tokenizer is not None:
                tokenizer.save_pretrained(directory)
            torch.save(state, directory / "trainer_state.pt")
            (directory / "rollout_state.json").write_text(json.dumps(rollout_state))
        if self.world > 1:
            dist.barrier()
        if self.rank == 0:
            (directory.parent / "latest").write_text(directory.name)
        return directory

    def lora_base_digest(self) -> str:
        """The frozen base's identity (lora.base_digest), taken once: the base never trains."""
        if self._lora_base_digest is None:
            self._lora_base_digest = lora.base_digest(self.model)
        return self._lora_base_digest

    def _save_full_weights(self, directory: Path) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:                  # the gathered weights, on rank 0 only, for serving
            self.model.save_pretrained(directory, state_dict=full)

    def _all_see(self, directory: Path) -> bool:
        """Does every rank see what rank 0 writes in `directory` (a shared filesystem)?"""
        mark = directory / ".rank0"
        if self.rank == 0:
            mark.write_text("")
        dist.barrier()
        seen = [None] * self.world
        dist.all_gather_object(seen, mark.exists())
        return all(seen)

    def load_weights_from_rank0(self, path: str) -> None:
        """Every rank takes the weights rank 0 reads from `path` (ranks on hosts that cannot read it
        built the model from its config)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from transformers import AutoModelForCausalLM
        box = [AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict() if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        for model in (self.model, self.reference):     # the reference was copied from the model as built
            if model is not None:
                set_model_state_dict(model, box[0], options=StateDictOptions(full_state_dict=True))

    def load(self, directory: Path) -> tuple[int, dict]:
        """Continue from a checkpoint (the weights were loaded from it with from_pretrained): the
        optimizer, the step and the random state; on every rank when sharded. A checkpoint of one
        rank resumes on k and one of k ranks on any number."""
        directory = Path(directory)
        state = torch.load(directory / "trainer_state.pt", weights_only=False) if self.rank == 0 else None
        if self.world > 1:                      # rank 0's: the others' hosts may not see the checkpoint
            box = [state]
            dist.broadcast_object_list(box, src=0)
            state = box[0]
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        if "optimizer" in state and self.world == 1:
            self.optimizer.load_state_dict(state["optimizer"])
        elif "optimizer" in state:              # one rank's optimizer (keyed by parameter order), onto k
            names = [n for n, _ in self.model.named_parameters()]
            saved = state["optimizer"]
            by_name = {"state": {names[i]: v for i, v in saved["state"].items()},
                       "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]}
            set_optimizer_state_dict(self.model, self.optimizer, by_name,
                                     options=StateDictOptions(full_state_dict=True))
        elif "optimizer_by_name" in state:      # gathered (no shared filesystem), onto this job's ranks
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer_by_name"],
                                     options=StateDictOptions(full_state_dict=True))
        else:                                   # sharded state, resharded onto this job's ranks
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            loaded = {"model": model_state, "optim": optim_state}
            dcp.load(loaded, checkpoint_id=str(directory / "sharded"))
            set_state_dict(self.model, self.optimizer, model_state_dict=loaded["model"],
                           optim_state_dict=loaded["optim"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        self.step_count = state["step"]
        rollout = directory / "rollout_state.json"
        return state["step"], json.loads(rollout.read_text()) if self.rank == 0 else {}
