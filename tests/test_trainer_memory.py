"""The trainer's memory bounds on models with real vocabularies: the LM head's logits computed a chunk of
positions at a time (trainer.logits_chunk_tokens, trainer_bridge/training/lm_head.py), micro-batches
cut by a token budget (trainer.max_tokens_per_micro_batch) and activation checkpointing
(trainer.gradient_checkpointing), each giving the update the plain path gives, to float rounding.
Tiny random Llama / Qwen2 models built from a config here, on CPU."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer_bridge.batch import TrainBatch
from trainer_bridge.config import TrainerConfig
from trainer_bridge.training import packing
from trainer_bridge.training.trainer import GRPOTrainer

ROOT = Path(__file__).resolve().parent.parent


def tiny(arch: str = "qwen2", vocab: int = 500, hidden: int = 64, layers: int = 2, heads: int = 4,
         tied: bool = True, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    torch.manual_seed(seed)
    return model_cls(config_cls(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                                intermediate_size=hidden * 2, tie_word_embeddings=tied,
                                max_position_embeddings=2048)).float()


def mixed_batch(seed: int, vocab: int, rows: int = 12, seq: int = 40, shortest: int = 6) -> TrainBatch:
    """Right-padded rows of `shortest`..seq tokens (prompt 4, the rest response), random advantages."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, seq + 1, (rows,), generator=g)
    inside = torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1)
    ids = torch.randint(3, vocab, (rows, seq), generator=g) * inside
    loss_mask = (inside & (torch.arange(seq) >= 4)).float()
    return TrainBatch(input_ids=ids, attention_mask=inside.long(), loss_mask=loss_mask,
                      behaviour_logprobs=-torch.rand(rows, seq, generator=g) * 4 * loss_mask,
                      versions=torch.zeros_like(ids), rewards=torch.zeros(rows), group_index=torch.arange(rows) // 4,
                      samples=[None] * rows, advantages=torch.randn(rows, generator=g))


def one_micro_batch(model, batch: TrainBatch, temperature: float, **cfg):
    """logprobs, entropy [rows, seq-1] and every parameter's gradient of one micro-batch's loss."""
    trainer = GRPOTrainer(model, TrainerConfig(device="cpu", **cfg), temperature=temperature)
    loss, _, _ = trainer._micro_batch(batch, float(batch.loss_mask.sum()))
    loss.backward()
    with torch.no_grad():
        logprobs, entropy = trainer._token_logprobs(model, batch, entropy=True)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs, entropy, grads


@pytest.mark.parametrize("arch,tied,pack_length", [("qwen2", True, 32), ("qwen2", True, 0), ("llama", False, 32)])
def test_chunked_logits_give_the_full_logits_logprobs_entropy_and_gradients(arch, tied, pack_length):
    """The same micro-batch through the head a few positions at a time (7: chunks that cut across
    sequences and packed rows) and through the whole logits at once (logits_chunk_tokens=0), with
    a temperature, an entropy bonus and a KL penalty to a reference: the same logprobs and
    entropies, and the same gradient on every parameter (the tied head and embedding included)."""
    batch = mixed_batch(0, vocab=500)
    cfg = dict(pack_length=pack_length, entropy_coef=0.05, kl_coef=0.1, tis_cap=2.0)
    full = one_micro_batch(tiny(arch, tied=tied), batch, 0.7, logits_chunk_tokens=0, **cfg)
    chunked = one_micro_batch(tiny(arch, tied=tied), batch, 0.7, logits_chunk_tokens=7, **cfg)
    keep = batch.attention_mask[:, 1:].bool()                # positions with a next token
    torch.testing.assert_close(chunked[0][keep], full[0][keep], atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked[1][keep], full[1][keep], atol=1e-5, rtol=0)
    assert chunked[0][~keep].abs().max() == 0                 # nothing past a row's end
    assert full[2].keys() == chunked[2].keys() and len(full[2]) == len(list(tiny(arch, tied=tied).parameters()))
    for name, grad in full[2].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(chunked[2][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_entropy_carries_gradient_only_with_an_entropy_bonus():
    """entropy_coef=0: the logged entropy is the same number, and the gradient is the policy loss's
    alone, so it differs from the one with the bonus."""
    batch = mixed_batch(1, vocab=500)
    off = one_micro_batch(tiny(), batch, 1.0, entropy_coef=0.0, logits_chunk_tokens=16)
    full_off = one_micro_batch(tiny(), batch, 1.0, entropy_coef=0.0, logits_chunk_tokens=0)
    on = one_micro_batch(tiny(), batch, 1.0, entropy_coef=0.5, logits_chunk_tokens=16)
    torch.testing.assert_close(off[1], on[1], atol=1e-6, rtol=0)
    head = "lm_head.weight" if "lm_head.weight" in off[2] else "model.embed_tokens.weight"
    torch.testing.assert_close(off[2][head], full_off[2][head], atol=1e-5, rtol=1e-4)
    assert (off[2][head] - on[2][head]).abs().max() > 1e-4


# A train step (forward + backward + AdamW) of 16 sequences x 1024 tokens on a vocabulary of 49,152:
# their float32 logits alone would take 3.2 GB. Run in its own process so its peak RSS is its own.
PEAK_SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
torch.set_num_threads(2)
from tests.test_trainer_memory import mixed_batch, tiny
from trainer_bridge.config import TrainerConfig
from trainer_bridge.training.trainer import GRPOTrainer

def rss_mb():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024

model = tiny("qwen2", vocab=49152, hidden=32, layers=1, heads=2)
trainer = GRPOTrainer(model, TrainerConfig(device="cpu", lr=1e-3, max_tokens_per_micro_batch=0))   # one micro-batch
trainer.train_step(mixed_batch(0, vocab=49152, rows=2, seq=64))          # warm-up: kernels, AdamW state
batch = mixed_batch(1, vocab=49152, rows=16, seq=1024, shortest=1024)
baseline = rss_mb()
metrics = trainer.train_step(batch)
# VmHWM: this process's own high-water mark. Not getrusage's ru_maxrss, which after a vfork + exec also
# counts the parent's peak (pytest's, 2.3 GB late in the suite) and so measured the suite, not the step.
peak = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024
print(json.dumps({"baseline_mb": baseline, "peak_mb": peak, "tokens": int(batch.attention_mask.sum()),
                  "loss": metrics["loss"]}))
"""


def test_a_micro_batch_whose_logits_take_gigabytes_trains_in_a_fraction_of_that():
    """One micro-batch of 16 x 1024 tokens at vocab 49,152 (no token budget, the default
    logits_chunk_tokens): the train step's peak RSS stays far under the 3.2 GB its float32 logits
    alone would take (whole logits, with log-softmax and gradient, peaked at ~3x their size)."""
    proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(ROOT)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    grown = out["peak_mb"] - out["baseline_mb"]
    print(f"peak RSS {out['peak_mb']:.0f} MB, {grown:.0f} MB above the {out['baseline_mb']:.0f} MB before the step")
    assert out["tokens"] == 16 * 1024 and out["loss"] == out["loss"]          # trained, no NaN
    assert grown < 1500, out


def test_micro_batches_group_rows_by_length_under_the_row_and_token_caps():
    lengths = [5, 40, 12, 33, 7, 90, 20, 20]
    groups = packing.micro_batches(lengths, max_rows=3, max_tokens=60)
    assert sorted(r for g in groups for r in g) == list(range(len(lengths)))         # every row once
    assert [5] in groups                                      # longer than the budget: a micro-batch alone
    for g in groups:
        assert len(g) <= 3 and (len(g) == 1 or sum(lengths[r] for r in g) <= 60), g
    assert packing.micro_batches(lengths, max_rows=3, max_tokens=0) == [[5, 1, 3], [6, 7, 2], [4, 0]]


def trained(batch: TrainBatch, **cfg):
    """Weights and metrics after one train step, and the tokens of each micro-batch it ran."""
    model = tiny(vocab=500)
    trainer = GRPOTrainer(model, TrainerConfig(device="cpu", lr=0.02, entropy_coef=0.01, **cfg))
    sizes, run = [], trainer._micro_batch

    def counted(mb, *args):
        sizes.append((len(mb.input_ids), int(mb.attention_mask.sum())))
        return run(mb, *args)
    trainer._micro_batch = counted
    metrics = trainer.train_step(batch)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, metrics, sizes


def test_a_token_budget_cuts_micro_batches_and_keeps_the_update():
    """trainer.max_tokens_per_micro_batch=100 over rows of 6..40 tokens: micro-batches of at most
    100 tokens (and micro_batch_size rows), and the weights land where one micro-batch of the
    whole batch puts them (one step, as in the packing test: rounding only)."""
    batch = mixed_batch(2, vocab=500, rows=16)
    whole, m0, sizes0 = trained(batch, micro_batch_size=64, max_tokens_per_micro_batch=0)
    cut, m1, sizes1 = trained(batch, micro_batch_size=6, max_tokens_per_micro_batch=100)
    assert sizes0 == [(16, int(batch.attention_mask.sum()))]
    assert len(sizes1) >= int(batch.attention_mask.sum()) // 100 + 1
    assert all(rows <= 6 and tokens <= 100 for rows, tokens in sizes1), sizes1
    assert sum(rows for rows, _ in sizes1) == 16
    for name in whole:
        torch.testing.assert_close(cut[name], whole[name], atol=2e-4, rtol=0, msg=name)
    for key in ("loss", "entropy", "ratio_mean", "grad_norm"):
        assert abs(m0[key] - m1[key]) < 1e-4 * max(1.0, abs(m0[key])), (key, m0[key], m1[key])


def test_gradient_checkpointing_keeps_the_update():
    """trainer.gradient_checkpointing recomputes each decoder layer in backward: the same step."""
    batch = mixed_batch(3, vocab=500)
    plain, m0, _ = trained(batch)
    checkpointed, m1, _ = trained(batch, gradient_checkpointing=True)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=2e-4, rtol=0, msg=name)
    assert abs(m0["loss"] - m1["loss"]) < 1e-5
    model = GRPOTrainer(tiny(), TrainerConfig(device="cpu", gradient_checkpointing=True)).model
    name = "is_activation_checkpointing" if hasattr(model, "is_activation_checkpointing") else "is_gradient_checkpointing"
    assert getattr(model, name)                              # (transformers 5 renamed it)


def test_gradient_checkpointing_on_a_model_without_it_names_the_setting():
    with pytest.raises(ValueError, match="trainer.gradient_checkpointing"):
        GRPOTrainer(torch.nn.Linear(2, 2), TrainerConfig(device="cpu", gradient_checkpointing=True))


def test_bad_memory_settings_name_the_field():
    problems = TrainerConfig(logits_chunk_tokens=-1, max_tokens_per_micro_batch=-8).problems()
    assert any(p.startswith("trainer.logits_chunk_tokens=-1") for p in problems), problems
    assert any(p.startswith("trainer.max_tokens_per_micro_batch=-8") for p in problems), problems
