"""Riptide on a real accelerator: the server, a weight push from device tensors, a short GRPO run.

Marked `gpu` (CUDA) or `npu` (Ascend, torch_npu) and skipped, with the reason, on a machine without
one. scripts/device_check.sh runs them (`pytest -m "gpu or npu"`) with the benches on a GPU machine.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

import platforms
from tests.conftest import start_server

ROOT = Path(__file__).resolve().parent.parent


def _kind(name: str, mark):
    platform = platforms.PLATFORMS[name]
    return pytest.param(name, marks=[mark, pytest.mark.skipif(
        not platform.is_available(), reason=f"no {name} device here (platforms.detect() found {platforms.detect().device_type})")])


DEVICES = [_kind("cuda", pytest.mark.gpu), _kind("npu", pytest.mark.npu)]


def generate(url, **body):
    r = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("kind", DEVICES)
def test_the_server_on_the_device_gives_transformers_logprobs(kind, tiny_model, tmp_path_factory):
    """float32 on the device: every logprob within 1e-3 of a transformers forward on the CPU
    (the outside check); then bf16, the accelerator default, serves a batch of greedy requests."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompts = [[11, 12, 13, 14, 15], list(range(100, 140)), [7]]
    srv = start_server(tiny_model, tmp_path_factory, "--device", kind, "--dtype", "float32")
    try:
        outs = generate(srv.url, input_ids=prompts, return_logprob=True,
                        sampling_params={"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True})
    finally:
        srv.stop()
    for prompt, out in zip(prompts, outs):
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out["output_ids"]])).logits[0, len(prompt) - 1:-1]
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(out["output_ids"])[:, None])[:, 0]
        assert torch.allclose(got, want, atol=1e-3), (got - want).abs().max()
    srv = start_server(tiny_model, tmp_path_factory, "--device", kind)
    try:
        info = httpx.get(f"{srv.url}/get_server_info", timeout=10).json()
        outs = generate(srv.url, input_ids=[list(range(20, 20 + n)) for n in (3, 40, 200)],
                        sampling_params={"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert [len(o["output_ids"]) for o in outs] == [12, 12, 12]
        assert "bfloat16" in str(info), info
    finally:
        srv.stop()


@pytest.mark.parametrize("kind", DEVICES)
def test_a_push_of_device_tensors_lands_in_a_server_on_the_device(kind, tiny_model, tiny_model_v2, tmp_path_factory):
    """The trainer's fp32 weights on the device, the server's bf16 on the device: the push converts
    on the device, stages through pinned host memory, and the server ends with exactly the bf16
    bytes of the trainer's weights, and serves them."""
    from transformers import AutoModelForCausalLM
    from weight_sync import live_digest, named_weights
    from weight_sync.sender import WeightSync
    device = platforms.choose_device(kind)
    trainer = AutoModelForCausalLM.from_pretrained(tiny_model_v2, dtype=torch.float32).to(device)
    srv = start_server(tiny_model, tmp_path_factory, "--device", kind, "--dtype", "bfloat16")
    sync = WeightSync([srv.url], bucket_bytes=1 << 20)
    try:
        stats = sync.push(trainer, version=1)
        assert stats.serving == {srv.url: 1} and stats.buckets > 1
        want = live_digest({n: t.to(torch.bfloat16) for n, t in named_weights(trainer).items()})
        got = httpx.get(f"{srv.url}/weight_sync/digest", timeout=60).json()["digest"]
        assert got == want
        out = generate(srv.url, input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert out["meta_info"]["weight_version"] == "1"
    finally:
        sync.close()
        srv.stop()


@pytest.mark.parametrize("kind", DEVICES)
def test_a_short_grpo_run_on_the_device(kind, tmp_path):
    """The built-in trainer and a server on the device, bf16, through Hydra, for a few steps."""
    proc = subprocess.run(
        [sys.executable, "-m", "trainer_bridge.train", f"run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}",
         f"trainer.device={kind}", f"server.device={kind}", "trainer.dtype=bfloat16", "trainer.steps=4",
         "rollout.group_size=4", "rollout.batch_size=4", "server.context_length=64", "logger.progress=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["steps"] == 4 and result["last_reward"] is not None, result
