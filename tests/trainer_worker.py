"""One rank of Riptide's built-in GRPO trainer (trainer_bridge.training.trainer.GRPOTrainer) on a fixed batch,
for tests/test_sharded.py: alone (no WORLD_SIZE), or as one of k gloo ranks (env RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT, as torchrun sets them), where the trainer shards the model with FSDP2.

    trainer_worker.py MODEL_PATH CKPT_DIR STEPS [--resume CHECKPOINT] OUT_JSON

Loads the model (from --resume's Hugging Face weights when given, and the trainer's state from it),
trains STEPS steps on the same seeded batch (11 rows, 2 mini-batches, micro-batches of 2: ranks run
unequal shares), saves a checkpoint in CKPT_DIR, and rank 0 writes each step's metrics to OUT_JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def batch(vocab: int):
    from trainer_bridge.batch import TrainBatch
    g = torch.Generator().manual_seed(7)
    n, length = 11, 14
    ids = torch.randint(3, vocab, (n, length), generator=g)
    attention = torch.ones(n, length, dtype=torch.long)
    loss_mask = torch.zeros(n, length)
    for row in range(n):
        end = length - row % 4                    # rows of different lengths, right-padded
        attention[row, end:] = 0
        loss_mask[row, 5:end] = 1
    behaviour = -torch.rand(n, length, generator=g) * 4 * loss_mask
    return TrainBatch(input_ids=ids, attention_mask=attention, loss_mask=loss_mask, behaviour_logprobs=behaviour,
                      versions=torch.zeros(n, length, dtype=torch.long), rewards=torch.zeros(n),
                      group_index=torch.arange(n), samples=[None] * n, advantages=torch.randn(n, generator=g))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_path")
    p.add_argument("ckpt_dir")
    p.add_argument("steps", type=int)
    p.add_argument("out")
    p.add_argument("--resume", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    from transformers import AutoModelForCausalLM

    from trainer_bridge.config import TrainerConfig
    from trainer_bridge.training.trainer import GRPOTrainer
    model = AutoModelForCausalLM.from_pretrained(a.resume or a.model_path, dtype=torch.float32)
    cfg = TrainerConfig(lr=3e-3, micro_batch_size=2, ppo_mini_batch_size=6, device="cpu")
    trainer = GRPOTrainer(model, cfg)
    if a.resume:
        trainer.load(Path(a.resume))
    data = batch(model.config.vocab_size)
    metrics = [trainer.train_step(data) for _ in range(a.steps)]
    trainer.save(Path(a.ckpt_dir), trainer.step_count, {"data": "test"})
    if trainer.rank == 0:
        Path(a.out).write_text(json.dumps({"world": trainer.world, "metrics": metrics}))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
