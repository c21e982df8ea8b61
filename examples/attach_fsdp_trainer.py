"""Riptide as the rollout backend of a sharded trainer that is not Riptide's: a plain FSDP2 loop
(`fully_shard`, data parallel over the ranks) doing REINFORCE with a group baseline.

    torchrun --nproc-per-node 2 examples/attach_fsdp_trainer.py [steps]

Rank 0 holds the RolloutBackend (servers, rollout, weight sync) and shares each batch with the other
ranks; every rank trains on its share of the rows (FSDP2 reduce-scatters the gradients). Every rank
takes part in the push: rank 0 calls `backend.push_weights`, the others `push_sharded`, and each
rank writes the rows of every parameter it holds straight into the servers: no rank gathers the model.
On CPU the ranks talk over gloo; on GPUs use nccl (and a device per rank).
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from inference_server.tiny_model import build_tiny_model
from rollout.config import RolloutConfig
from trainer_bridge import BackendConfig, RolloutBackend
from trainer_bridge.config import TaskConfig
from weight_sync.sharded import RankState, push_sharded

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
path = os.environ.get("RIPTIDE_EXAMPLE_MODEL", ".cache/tiny-chars")
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if rank == 0 and not os.path.isdir(path):
    build_tiny_model(path, hidden=128, layers=2, heads=4, tokenizer="chars")
dist.barrier()                                                    # the checkpoint exists for everyone
model = AutoModelForCausalLM.from_pretrained(path)
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

backend, shard = None, RankState()                                # shard: a rank > 0's engine, kept between pushes
if rank == 0:
    cfg = BackendConfig(model_path=path, task=TaskConfig(name="copy", num_digits=2),
                        rollout=RolloutConfig(group_size=8, batch_size=8, max_new_tokens=3, oversample=1.5,
                                              use_chat_template="false"))
    backend = RolloutBackend(cfg)
try:
    if rank == 0:
        backend.start()                                           # the servers serve the checkpoint: version 0
    for step in range(steps):
        box = [None]
        if rank == 0:
            batch = backend.next_batch()
            box = [{"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                    "loss_mask": batch.loss_mask, "advantages": batch.advantages,
                    "reward": float(batch.rewards.mean()), "staleness": batch.metrics['staleness_max']}]
        dist.broadcast_object_list(box, src=0)
        b = box[0]
        mine = slice(rank, None, world)                           # this rank's share of the rows
        ids, mask = b["input_ids"][mine], b["loss_mask"][mine, 1:]
        logits = model(input_ids=ids, attention_mask=b["attention_mask"][mine]).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(logp * b["advantages"][mine, None] * mask).sum() / b["loss_mask"][:, 1:].sum() * world
        optimizer.zero_grad()
        loss.backward()                                           # gradients averaged over the ranks
        optimizer.step()
        if rank == 0:
            backend.push_weights(model, version=step + 1)         # with the other ranks' own writes
            print(f"step {step}: reward {b['reward']:.3f}  staleness {b['staleness']}", flush=True)
        else:
            push_sharded(model, step + 1, state=shard)
finally:
    if backend is not None:
        backend.close()
    dist.destroy_process_group()
