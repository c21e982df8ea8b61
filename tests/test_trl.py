"""Riptide inside TRL (`pip install 'riptide[trl]'`, `make setup-trl`): TRL's GRPOTrainer with Riptide's
servers generating, and TRL's AsyncGRPOTrainer over Riptide's async manager and weight sync. Real
parts throughout: TRL's trainers, Riptide's servers over HTTP, pushes over the Mooncake engine."""
from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("trl", reason="TRL is not installed: `make setup-trl` (or pip install 'riptide[trl]')")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

ROOT = Path(__file__).resolve().parents[1]


def example():
    spec = importlib.util.spec_from_file_location("trl_grpo_example", ROOT / "examples" / "trl_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def chars_model(tmp_path_factory):
    from inference_server.tiny_model import build_tiny_model
    return str(build_tiny_model(tmp_path_factory.mktemp("trl-chars"), hidden=128, layers=2, heads=4,
                                tokenizer="chars", seed=0))


def server_versions(backend) -> list[int]:
    return [int(httpx.get(f"{u}/get_weight_version", timeout=10).json()["weight_version"]) for u in backend.servers]


def test_grpo_trainer_on_riptide_learns_the_demo_task_and_samples_each_step_on_the_last_steps_weights(
        chars_model, tmp_path):
    ex = example()
    seen: list[list[int]] = []                  # per generation: each completion's weight version

    def reward(completions, answer, weight_version, **kwargs):
        seen.append(list(weight_version))
        return ex.copy_reward(completions, answer)

    steps = 100                                 # 60 fell short of the margin once in a full suite's run
    trainer = ex.main(steps, out=str(tmp_path / "out"), path=chars_model, reward_funcs=reward, close_at_end=False)
    try:
        # every step's completions were sampled by the weights the trainer pushed after the step before
        assert [sorted(set(v)) for v in seen] == [[k] for k in range(steps)]
        assert server_versions(trainer.riptide) == [steps]
    finally:
        trainer.riptide.close()
    history = [h for h in trainer.state.log_history if "reward" in h]
    rewards = [h["reward"] for h in history]
    first, last = rewards[:15], rewards[-15:]
    spread = (sum((r - sum(first) / 15) ** 2 for r in first) / 14) ** 0.5
    # reward up by more than the noise of the early steps (about 0.06 -> 0.15 here)
    assert sum(last) / 15 > sum(first) / 15 + max(0.03, spread), (first, last)
    # Riptide's servers compute in fp32 like the trainer: its logprobs match, so the weights stay near 1
    ratios = [h["sampling/importance_sampling_ratio/mean"] for h in history]
    assert all(0.9 < r < 1.1 for r in ratios), ratios


def test_a_peft_model_in_grpo_trainer_pushes_its_adapter_alone_and_samples_each_step_on_the_last_steps(
        chars_model, tmp_path):
    """TRL trains a LoRA adapter (peft_config): every push carries the adapter alone, every step's
    completions come from the adapter version the step before pushed, and the servers serve the
    trained adapter merged as peft merges it (greedy tokens equal, logprobs within 1e-5, fp32)."""
    import copy

    from peft import LoraConfig

    from trainer_bridge.integrations.trl import unwrap
    ex = example()
    seen: list[list[int]] = []

    def reward(completions, answer, weight_version, **kwargs):
        seen.append(list(weight_version))
        return ex.copy_reward(completions, answer)
    steps = 6
    peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                 "up_proj", "down_proj"])
    trainer = ex.main(steps, out=str(tmp_path / "out"), path=chars_model, reward_funcs=reward, close_at_end=False,
                      peft_config=peft_config)
    try:
        assert [sorted(set(v)) for v in seen] == [[k] for k in range(steps)]
        assert server_versions(trainer.riptide) == [steps]
        push = trainer.riptide.last_push
        assert set(push.modes.values()) == {"adapter"} and push.bytes < 0.2 * push.model_bytes
        merged = copy.deepcopy(unwrap(trainer.model)).merge_and_unload().eval().float()
        prompts = [[5, 6, 7, 8], [9, 10, 11]]
        outs = trainer.riptide.generate(prompts, {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True})
        for ids, out in zip(prompts, outs):
            with torch.no_grad():
                logits = merged(torch.tensor([ids + out.output_ids])).logits[0, len(ids) - 1:-1]
            assert out.output_ids == logits.argmax(-1).tolist()
            want = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(out.logprobs), want, atol=1e-5)
    finally:
        trainer.riptide.close()


def test_importance_sampling_weights_are_computed_from_riptides_logprobs(chars_model, tmp_path):
    """TRL takes its importance-sampling correction on its vLLM path only; RiptideGRPOTrainer takes it
    on the logprobs Riptide's servers returned. Shift those logprobs by -1 a token and the
    token-level weight becomes e (the trainer's own logprob minus the sampler's); a trainer that
    ignored them would show none, or 1."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from rollout.config import RolloutConfig
    from rollout.tasks import digit_items
    from trainer_bridge import BackendConfig, RolloutBackend
    from trainer_bridge.integrations.trl import RiptideGRPOTrainer

    backend = RolloutBackend(BackendConfig(model_path=chars_model, rollout=RolloutConfig(use_chat_template="false")))
    sent: list[list[float]] = []
    generate = backend.generate

    def shifted(prompts, sampling_params=None):
        gens = generate(prompts, sampling_params)
        for g in gens:
            g.logprobs = [lp - 1.0 for lp in g.logprobs]
            sent.append(g.logprobs)
        return gens
    backend.generate = shifted
    rows = digit_items("copy", num_digits=2, count=64, seed=0)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, learning_rate=1e-3, per_device_train_batch_size=16,
                      num_generations=8, max_completion_length=3, beta=0.0, report_to="none", save_strategy="no",
                      use_cpu=True, vllm_importance_sampling_mode="token_truncate",
                      vllm_importance_sampling_clip_max=100.0, vllm_importance_sampling_clip_min=0.0)
    trainer = RiptideGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(chars_model), args=args,
                                 reward_funcs=example().copy_reward, processing_class=AutoTokenizer.from_pretrained(chars_model),
                                 train_dataset=Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]),
                                 backend=backend)
    outputs = []
    score = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda inputs: outputs.append(score(inputs)) or outputs[-1]
    trainer.train()
    out = outputs[0]
    mask = out["completion_mask"].bool()
    got = out["sampling_per_token_logps"]
    for row, lps in enumerate(sent):
        assert torch.allclose(got[row, :len(lps)], torch.tensor(lps)), row
    ratio = out["importance_sampling_ratio"][mask]
    expected = torch.exp(out["old_per_token_logps"] - got)[mask]
    assert torch.allclose(ratio, expected, rtol=1e-4)
    assert abs(ratio.mean().item() - math.e) < 0.2, ratio.mean()


def test_what_riptides_servers_cannot_sample_is_refused_before_anything_starts(chars_model, tmp_path):
    from trl import GRPOConfig

    from trainer_bridge import BackendConfig, RolloutBackend
    from trainer_bridge.integrations.trl import RiptideGRPOTrainer
    backend = RolloutBackend(BackendConfig(model_path=chars_model))
    for bad, word in ((dict(repetition_penalty=1.3), "repetition_penalty"), (dict(use_vllm=True), "use_vllm")):
        args = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **bad)
        with pytest.raises(ValueError, match=word):
            RiptideGRPOTrainer(model=chars_model, reward_funcs=lambda completions, **k: [0.0] * len(completions),
                               args=args, train_dataset=None, backend=backend)
    assert backend.servers == [] and backend.sync is None


def cpu_flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True, window_size=(-1, -1),
                          **kwargs):
    """flash_attn_varlen_func's math on CPU: causal attention per packed segment, aligned to the
    segment's last key (FlashAttention's convention when a segment has more keys than queries)."""
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        rep = qs.shape[1] // ks.shape[1]
        ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
        nq, nk = qs.shape[0], ks.shape[0]
        mask = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
        o = torch.nn.functional.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1),
                                                             vs.transpose(0, 1), attn_mask=mask, scale=softmax_scale)
        out[cu_q[i]:cu_q[i + 1]] = o.transpose(0, 1)
    return out


def test_async_grpo_trainer_trains_on_riptides_rollout_worker_and_weight_transfer(chars_model, tmp_path, monkeypatch):
    """TRL's own stub-based test (tests/experimental/test_async_grpo_trainer.py::test_train) with
    Riptide's two protocol objects in place of the stubs. Two GPU-only parts of AsyncGRPOTrainer are
    replaced, because they cannot run here: its FlashAttention-3 kernel (fetched from the Hub with
    `kernels`, CUDA only) by the same varlen causal attention on CPU, and its CUDA device query for
    MFU by 'unknown'."""
    import trl.experimental.async_grpo.async_grpo_trainer as async_trainer
    import trl.experimental.async_grpo.packing as packing
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from rollout.config import RolloutConfig
    from trainer_bridge import BackendConfig, RolloutBackend
    from trainer_bridge.config import TaskConfig
    from trainer_bridge.integrations.trl import RiptideRolloutWorker, RiptideWeightTransfer

    monkeypatch.setattr(packing, "_flash_attn", lambda: type("FA", (), {"flash_attn_varlen_func":
                                                                        staticmethod(cpu_flash_attn_varlen)}))
    monkeypatch.setattr(async_trainer, "get_peak_flops_per_device", lambda *a, **k: None)
    backend = RolloutBackend(BackendConfig(
        model_path=chars_model, task=TaskConfig(name="copy", num_digits=2),
        rollout=RolloutConfig(group_size=4, batch_size=4, max_new_tokens=3, use_chat_template="false")))
    worker = RiptideRolloutWorker(backend)
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), max_steps=4, learning_rate=0.01,
                           per_device_train_batch_size=16, num_generations=4, max_completion_length=3,
                           report_to="none", save_strategy="no", use_cpu=True, bf16=False, token_budget=64,
                           logging_steps=1)
    trainer = AsyncGRPOTrainer(model=chars_model, reward_funcs=lambda completions, **k: [0.0] * len(completions),
                               args=args, train_dataset=Dataset.from_list([{"prompt": "copy:12="}] * 64),
                               processing_class=AutoTokenizer.from_pretrained(chars_model), rollout_worker=worker,
                               weight_transfer=RiptideWeightTransfer(backend, close_at_end=False))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    try:
        trainer.train()
        # the train-begin sync and one per step: the servers serve what the trainer calls its version
        assert server_versions(backend) == [trainer.model_version] == [args.max_steps + 1]
    finally:
        worker.stop()
        backend.close()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert all(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in before.items())
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert len(rewards) == args.max_steps and all(0.0 <= r <= 1.0 for r in rewards)   # the task's partial credit


def test_the_weight_callback_pushes_the_model_inside_a_ddp_wrapper(chars_model):
    """What accelerate hands a callback under DDP is the wrapper: the callback pushes the model
    inside it, as version global_step, and the servers then score tokens as that model does."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM, TrainerState

    from platforms.process import free_port
    from trainer_bridge import BackendConfig, RolloutBackend
    from trainer_bridge.integrations.trl import RiptideWeightSync

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}", rank=0, world_size=1)
    backend = RolloutBackend(BackendConfig(model_path=chars_model))
    try:
        model = AutoModelForCausalLM.from_pretrained(chars_model, dtype=torch.float32)
        callback, state = RiptideWeightSync(backend, close_at_end=False), TrainerState()
        callback.on_train_begin(None, state, None, model=DistributedDataParallel(model))
        with torch.no_grad():                                     # a training step
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        state.global_step = 1
        callback.on_step_end(None, state, None, model=DistributedDataParallel(model))
        assert server_versions(backend) == [1]
        prompt = [5, 6, 7, 8]
        gen = backend.generate([prompt], {"temperature": 0.0, "max_new_tokens": 4})[0]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + gen.output_ids])).logits[0, len(prompt) - 1:-1]
        want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(gen.output_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(gen.logprobs), want, atol=1e-3)
        assert gen.versions == [1] * len(gen.output_ids)
    finally:
        backend.close()
        dist.destroy_process_group()
