"""LoRA adapters (trainer.lora, trainer_bridge/training/lora.py): the weights a peft model computes with,
pushed by the base's names, served exactly; a riptide-train job that trains only the adapter."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft", reason="peft is the lora extra (make setup installs it)")

ROOT = Path(__file__).resolve().parents[1]


def adapted(path, seed: int = 1):
    """The tiny model at `path` with a rank-8 adapter whose B is random (a fresh one computes nothing)."""
    from transformers import AutoModelForCausalLM

    from trainer_bridge.training import lora
    model = lora.with_adapters(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), 8, 16.0, 0.0, [])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def test_merged_weights_are_peft_merge_and_unload_by_the_base_names(tiny_model):
    import copy

    from trainer_bridge.training import lora
    model = adapted(tiny_model)
    merged = lora.merged_weights(model)
    reference = copy.deepcopy(model).merge_and_unload()
    want = dict(reference.named_parameters())
    assert set(merged) == set(want)
    for name, t in merged.items():
        assert torch.equal(t, want[name]), name
    assert lora.adapter_share(model) < 0.5
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)


def served(backend, prompts, reference) -> float:
    """The servers' greedy tokens against `reference`'s (equal) and the largest logprob difference."""
    outs = backend.generate(prompts, {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True})
    worst = 0.0
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            logits = reference(torch.tensor([ids + out.output_ids])).logits[0, len(ids) - 1:-1]
        assert out.output_ids == logits.argmax(-1).tolist()
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
        worst = max(worst, (torch.tensor(out.logprobs) - want).abs().max().item())
    return worst


def backend_config(path, tmp_path, **weight_sync):
    from rollout.config import RolloutConfig
    from trainer_bridge.backend import BackendConfig
    from trainer_bridge.config import ServerConfig, WeightSyncConfig
    return BackendConfig(path, server=ServerConfig(context_length=64, dtype="float32", device="cpu"),
                         rollout=RolloutConfig(max_new_tokens=8), weight_sync=WeightSyncConfig(**weight_sync),
                         log_dir=str(tmp_path / "logs"))


PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_an_adapter_push_moves_the_adapter_alone_and_serves_peft_s_merged_model(tiny_model, tmp_path):
    """push_weights(peft_model): the adapter's tensors alone go on the wire; each server merges them into
    the base it keeps, so after every push it serves exactly peft's merge_and_unload of that version
    (greedy tokens equal, logprobs within 1e-5, fp32), version 2 onto the base and not onto version 1."""
    import copy

    from trainer_bridge.backend import RolloutBackend
    model = adapted(tiny_model, seed=1)
    with RolloutBackend(backend_config(tiny_model, tmp_path)) as backend:
        backend.start(manager=False)
        for version, seed in ((1, 1), (2, 2)):
            model = adapted(tiny_model, seed=seed)
            stats = backend.push_weights(model, version)
            assert stats.modes and set(stats.modes.values()) == {"adapter"}
            assert stats.wire_bytes == stats.bytes < 0.2 * stats.model_bytes
            assert stats.merge_s > 0
            assert served(backend, PROMPTS, copy.deepcopy(model).merge_and_unload().eval()) < 1e-5
            outs = backend.generate(PROMPTS, {"temperature": 0.0, "max_new_tokens": 4})
            assert all(set(o.versions) == {version} for o in outs)


def test_merged_pushes_of_a_peft_model_serve_the_same(tiny_model, tmp_path):
    """weight_sync.adapter_only=false: the merged weights go whole, and serve the same model."""
    import copy

    from trainer_bridge.backend import RolloutBackend
    model = adapted(tiny_model, seed=3)
    with RolloutBackend(backend_config(tiny_model, tmp_path, adapter_only=False)) as backend:
        backend.start(manager=False)
        stats = backend.push_weights(model, 1)
        assert set(stats.modes.values()) == {"full"} and stats.model_bytes == 0
        assert served(backend, PROMPTS, copy.deepcopy(model).merge_and_unload().eval()) < 1e-5


def test_an_adapter_for_another_base_is_refused_before_any_byte_moves(tiny_model, tiny_model_v2, tmp_path):
    """The servers hold tiny_model_v2; an adapter trained on tiny_model names its base, which differs:
    the push fails naming the server, and the servers go on serving what they served, unchanged."""
    from transformers import AutoModelForCausalLM

    from trainer_bridge.backend import RolloutBackend
    from weight_sync.sender import WeightSyncError
    served_model = AutoModelForCausalLM.from_pretrained(tiny_model_v2, dtype=torch.float32).eval()
    with RolloutBackend(backend_config(tiny_model_v2, tmp_path)) as backend:
        backend.start(manager=False)
        with pytest.raises(WeightSyncError, match="holds another base model than this adapter's"):
            backend.push_weights(adapted(tiny_model), 1)
        assert served(backend, PROMPTS, served_model) < 1e-5
        outs = backend.generate(PROMPTS, {"temperature": 0.0, "max_new_tokens": 4})
        assert all(set(o.versions) == {0} for o in outs)


def test_a_lora_job_trains_only_the_adapter(tmp_path):
    """riptide-train with trainer.lora.rank: the base stays as it was (its embedding, norms and head
    bit for bit in the checkpoint's merged weights), the adapted projections moved, the adapter is
    saved apart, and every step's weights went to the servers."""
    from safetensors.torch import load_file
    proc = subprocess.run([sys.executable, "-m", "trainer_bridge.train", f"run_dir={tmp_path / 'run'}",
                           f"model.path={tmp_path / 'model'}", "rollout.group_size=4", "rollout.batch_size=4",
                           "server.context_length=64", "logger.progress=false", "trainer.steps=6",
                           "trainer.val_every=0", "trainer.lora.rank=8"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 6
    ckpt = tmp_path / "run" / "checkpoints" / (tmp_path / "run" / "checkpoints" / "latest").read_text()
    assert (ckpt / "adapter" / "adapter_config.json").exists()
    before, after = load_file(tmp_path / "model" / "model.safetensors"), load_file(ckpt / "model.safetensors")
    frozen = [n for n in before if "proj" not in n]
    assert frozen and all(torch.equal(before[n], after[n]) for n in frozen)
    assert any(not torch.equal(before[n], after[n]) for n in before if "q_proj" in n or "down_proj" in n)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and all(r["sync/bytes"] > 0 for r in lines)


def test_lora_settings_are_checked_before_start():
    from trainer_bridge.config import ConfigError, TrainerConfig
    cfg = TrainerConfig()
    cfg.lora.rank, cfg.lora.alpha, cfg.world_size = -1, 0.0, 2
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert "trainer.lora.rank=-1" in str(e.value) and "trainer.lora.alpha=0.0" in str(e.value)
    cfg.lora.rank, cfg.lora.alpha = 8, 16.0
    with pytest.raises(ConfigError, match=r"trainer.lora.rank=8 with trainer.world_size=2"):
        cfg.validate()
