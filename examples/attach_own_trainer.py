"""Riptide as the rollout backend of a training loop that is not Riptide's: plain PyTorch REINFORCE
with a group baseline. Riptide starts the servers, generates GRPO groups asynchronously and streams
each new version of the weights into the servers; the loop below owns the model and the optimizer.

    python examples/attach_own_trainer.py [steps]
"""
import sys

import torch
from transformers import AutoModelForCausalLM

from inference_server.tiny_model import build_tiny_model
from rollout.config import RolloutConfig
from trainer_bridge import BackendConfig, RolloutBackend
from trainer_bridge.config import TaskConfig

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
path = ".cache/tiny-chars"
try:
    model = AutoModelForCausalLM.from_pretrained(path)
except OSError:
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(path, hidden=128, layers=2, heads=4, tokenizer="chars"))
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

cfg = BackendConfig(model_path=path, task=TaskConfig(name="copy", num_digits=2),
                    rollout=RolloutConfig(group_size=8, batch_size=8, max_new_tokens=3, oversample=1.5,
                                          use_chat_template="false"))   # raw "copy:12=" prompts
with RolloutBackend(cfg) as backend:
    backend.start(model)                                          # initial weights, version 0
    for step in range(steps):
        batch = backend.next_batch()                              # padded tensors + advantages
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
        mask = batch.loss_mask[:, 1:]
        loss = -(logp * batch.advantages[:, None] * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        backend.push_weights(model, version=step + 1)             # streamed over Mooncake, two-phase
        print(f"step {step}: reward {batch.rewards.mean():.3f}  staleness {batch.metrics['staleness_max']}")
