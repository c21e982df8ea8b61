"""TRL's GRPOTrainer with Riptide generating: the trainer, its reward function, its loss and its
optimizer are TRL's; Riptide's servers sample every completion (with per-token logprobs, which TRL's
importance-sampling correction uses), and each optimizer step's weights are streamed into them.

    pip install 'riptide[trl]'       # or: make setup-trl
    python examples/trl_grpo.py [steps]

The task is the demo's: copy a digit string ("copy:42=" -> "42"), rewarded with partial credit.
"""
import os
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")          # rollout_func is experimental in TRL 1.x

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from inference_server.tiny_model import build_tiny_model
from rollout.config import RolloutConfig
from rollout.tasks import digit_items, partial_credit_score
from trainer_bridge import BackendConfig, RolloutBackend
from trainer_bridge.integrations.trl import RiptideGRPOTrainer


def copy_reward(completions, answer, **kwargs):
    return [partial_credit_score(c, a) for c, a in zip(completions, answer)]


def main(steps: int = 30, out: str = ".cache/trl-grpo", path: str = ".cache/tiny-chars", reward_funcs=None,
         close_at_end: bool = True, peft_config=None):
    """Trains for `steps`; returns the trainer (its state.log_history has the per-step rewards). With
    `peft_config` (a peft LoraConfig) TRL trains a LoRA adapter, and each push carries the adapter alone."""
    if not os.path.exists(os.path.join(path, "config.json")):
        build_tiny_model(path, hidden=128, layers=2, heads=4, tokenizer="chars")
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = digit_items("copy", num_digits=2, count=512, seed=0)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    args = GRPOConfig(output_dir=out, max_steps=steps, learning_rate=3e-3, per_device_train_batch_size=64,
                      num_generations=8, max_completion_length=3, temperature=1.0, beta=0.0, lr_scheduler_type="constant",
                      logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, seed=0)
    backend = RolloutBackend(BackendConfig(model_path=path, rollout=RolloutConfig(use_chat_template="false")))
    trainer = RiptideGRPOTrainer(model=model, reward_funcs=reward_funcs or copy_reward, args=args,
                                 train_dataset=dataset, processing_class=tokenizer, backend=backend,
                                 close_at_end=close_at_end, peft_config=peft_config)
    trainer.train()                   # starts the servers, pushes after every step, stops them at the end
    return trainer


if __name__ == "__main__":
    trainer = main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
    for h in [h for h in trainer.state.log_history if "reward" in h]:
        print(f"step {h['step']}: reward {h['reward']:.3f}  "
              f"is_ratio {h.get('sampling/importance_sampling_ratio/mean', float('nan')):.3f}")
