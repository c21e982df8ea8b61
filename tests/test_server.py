"""The embedded server over real HTTP on loopback, with a tiny model, against plain transformers.
Every test on `server` runs twice: with the contiguous KV layout and the paged one (the CPU default where
its kernel builds)."""
import asyncio
import json
import threading
import time

import httpx
import pytest
import torch

from tests.conftest import start_server


@pytest.fixture(scope="module", params=["contiguous", "paged"])
def server(request, tiny_model, tmp_path_factory):
    srv = start_server(tiny_model, tmp_path_factory, "--kv-layout", request.param)
    yield srv
    srv.stop()


def generate(server, **body):
    r = httpx.post(f"{server.url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def reference_logprobs(model, prompt, output, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def test_meta_info_says_which_weights_made_the_prompts_keys_and_values(server):
    body = dict(input_ids=list(range(5, 205)), sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    first = generate(server, **body)["meta_info"]
    again = generate(server, kv_policy="continue", **body)["meta_info"]     # no older weights kept: as fresh
    for m in (first, again):
        assert m["kv_versions"] == [[0, 200, 0]] and m["kv_age"] == 0 and m["kv_cache_weight_version"] == 0


def test_end_episode_and_flush_cache_let_go_of_cached_blocks(server):
    body = dict(input_ids=list(range(300, 560)), sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    out = generate(server, **body)
    paged = "paged" in server.args
    r = httpx.post(f"{server.url}/end_episode", json={"input_ids": body["input_ids"] + out["output_ids"],
                                                      "shared_tokens": 100}, timeout=30).json()
    assert r["success"] and (r["blocks"] >= 1 if paged else r["blocks"] == 0)
    assert generate(server, **body)["meta_info"]["cached_tokens"] == (256 if paged else 0)   # still there
    assert httpx.post(f"{server.url}/flush_cache", timeout=30).json()["success"]
    assert generate(server, **body)["meta_info"]["cached_tokens"] == 0
    bad = httpx.post(f"{server.url}/end_episode", json={"input_ids": [1, 2], "shared_tokens": -1}, timeout=30)
    assert bad.status_code == 400 and "shared_tokens" in bad.json()["error"]


def test_single_generate(server):
    out = generate(server, text="12 + 34 =", sampling_params={"max_new_tokens": 9, "ignore_eos": True})
    assert len(out["output_ids"]) == 9
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 9}
    assert out["meta_info"]["completion_tokens"] == 9
    assert isinstance(out["text"], str) and out["meta_info"]["weight_version"] == "0"
    assert out["meta_info"]["output_token_versions"] == [0] * 9


def test_batch_generate(server):
    outs = generate(server, text=["one", "two two", "three three three"],
                    sampling_params={"max_new_tokens": 5, "ignore_eos": True})
    assert isinstance(outs, list) and len(outs) == 3
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [5, 5, 5]
    ids = generate(server, input_ids=[[5, 6, 7], [8, 9]], sampling_params=[
        {"max_new_tokens": 2, "ignore_eos": True}, {"max_new_tokens": 4, "ignore_eos": True}])
    assert [len(o["output_ids"]) for o in ids] == [2, 4]


def test_n_samples_and_seed(server):
    body = dict(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 8, "n": 3, "seed": 7, "ignore_eos": True})
    a, b = generate(server, **body), generate(server, **body)
    assert len(a) == 3 and [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    assert len({tuple(o["output_ids"]) for o in a}) > 1, "n samples of one prompt should differ"


def test_streaming(server):
    chunks = []
    with httpx.stream("POST", f"{server.url}/generate", timeout=60, json={
            "input_ids": [3, 4, 5], "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    assert [len(e["output_ids"]) for e in events] == [1, 2, 3, 4, 5, 6]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert len(events[-1]["meta_info"]["output_token_logprobs"]) == 6


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_transformers(server, hf_model, temperature):
    prompts = [[11, 12, 13, 14, 15], list(range(100, 140)), [7]]
    outs = generate(server, input_ids=prompts, return_logprob=True,
                    sampling_params={"max_new_tokens": 24, "temperature": temperature, "ignore_eos": True})
    for prompt, out in zip(prompts, outs):
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
        want = reference_logprobs(hf_model, prompt, out["output_ids"], temperature)
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_greedy_equals_transformers_generate(server, hf_model):
    # ragged lengths and staggered ends: decode attention runs in length chunks over slots that get
    # re-sorted as sequences join and leave (moves and permutations of the KV cache)
    # (20 rows: on a CPU server with one torch thread, big steps also run as two halves on two threads)
    prompts = [[21, 22, 23], list(range(300, 360)), [42, 43], list(range(500, 900)), list(range(40, 52)),
               list(range(1000, 1130)), [7, 8, 9, 10], list(range(60, 260))]
    prompts += [list(range(100 + 7 * i, 100 + 7 * i + 5 + 37 * (i % 5))) for i in range(12)]
    budgets = [20, 6, 14, 20, 3, 11, 17, 8] + [4 + (5 * i) % 17 for i in range(12)]
    outs = generate(server, input_ids=prompts, sampling_params=[
        {"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in budgets])
    for prompt, n, out in zip(prompts, budgets, outs):
        assert len(out["output_ids"]) == n
        # teacher-forced through transformers: every token is its argmax, up to float ties (the
        # batched kernels round differently from a lone forward, which can flip a near-tie)
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + out["output_ids"]])).logits[0, len(prompt) - 1:-1]
        chosen = logits.gather(1, torch.tensor(out["output_ids"])[:, None])[:, 0]
        assert torch.all(chosen >= logits.max(dim=1).values - 1e-4), (logits.max(dim=1).values - chosen).max()


def test_stop_token_ids_and_stop_strings(server):
    base = generate(server, input_ids=[30, 31, 32], sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                                     "ignore_eos": True})
    stop_at = base["output_ids"][4]
    first = base["output_ids"].index(stop_at)
    out = generate(server, input_ids=[30, 31, 32], sampling_params={
        "max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "stop_token_ids": [stop_at]})
    assert out["output_ids"] == base["output_ids"][:first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    text = base["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    out = generate(server, input_ids=[30, 31, 32], sampling_params={
        "max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"] and text.startswith(out["text"])


class LongRequest(threading.Thread):
    """A streaming request in a thread; `started` is set once its first token has arrived."""

    def __init__(self, server, rid, max_new_tokens=1000, **sampling):
        super().__init__()
        self.started, self.result = threading.Event(), None
        self.body = {"input_ids": [9, 8, 7, 6], "rid": rid, "stream": True, "return_logprob": True,
                     "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, **sampling}}
        self.url = f"{server.url}/generate"
        self.start()
        assert self.started.wait(60), "request never started"

    def run(self):
        with httpx.stream("POST", self.url, json=self.body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.result = json.loads(line[6:])
                    self.started.set()

    def finish(self):
        self.join(60)
        return self.result


def test_abort_returns_partial_tokens_and_logprobs(server):
    req = LongRequest(server, "long-abort")
    r = httpx.post(f"{server.url}/abort_request", json={"rid": "long-abort"})
    assert r.status_code == 200 and r.json()["aborted"] == ["long-abort"]
    out = req.finish()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < 1000
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
    assert len(out["meta_info"]["output_token_versions"]) == len(out["output_ids"])


def test_a_client_that_goes_away_has_its_request_aborted(server):
    """A rollout client that gave up on a request (it moved it elsewhere) must not leave the server
    generating it to the end. Generation is held while the client goes, so the request cannot
    finish first."""
    def info():
        return httpx.get(f"{server.url}/get_server_info").json()
    before = info()["stats"]["aborted_requests"]
    httpx.post(f"{server.url}/pause_generation", json={"mode": "in_place"})
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/generate", timeout=0.5, json={
                "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}})
        deadline = time.monotonic() + 30
        while info()["stats"]["aborted_requests"] == before and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        httpx.post(f"{server.url}/continue_generation")
    after = info()
    assert after["stats"]["aborted_requests"] == before + 1 and after["num_running"] + after["num_waiting"] == 0


def test_pause_abort_mode(server):
    req = LongRequest(server, "p-abort")
    assert httpx.post(f"{server.url}/pause_generation", json={"mode": "abort"}).json()["success"]
    assert req.finish()["meta_info"]["finish_reason"]["type"] == "abort"
    # while paused a new request waits; it runs once generation continues
    later = {}
    t2 = threading.Thread(target=lambda: later.update(out=generate(
        server, input_ids=[1, 2], sampling_params={"max_new_tokens": 3, "ignore_eos": True})))
    t2.start()
    time.sleep(0.5)
    assert "out" not in later
    assert httpx.get(f"{server.url}/get_server_info").json()["num_waiting"] == 1
    httpx.post(f"{server.url}/continue_generation")
    t2.join(30)
    assert later["out"]["meta_info"]["completion_tokens"] == 3


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_keeps_requests(server, mode):
    ref = generate(server, input_ids=[9, 8, 7, 6], sampling_params={"max_new_tokens": 1000, "temperature": 0,
                                                                     "ignore_eos": True})
    req = LongRequest(server, f"p-{mode}", temperature=0)
    assert httpx.post(f"{server.url}/pause_generation", json={"mode": mode}).json()["success"]
    info = httpx.get(f"{server.url}/get_server_info").json()
    assert info["paused"]
    assert (info["num_running"], info["num_waiting"]) == ((1, 0) if mode == "in_place" else (0, 1))
    tokens = info["stats"]["generation_tokens"]
    time.sleep(0.4)
    assert httpx.get(f"{server.url}/get_server_info").json()["stats"]["generation_tokens"] == tokens
    httpx.post(f"{server.url}/continue_generation")
    out = req.finish()
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["output_ids"] == ref["output_ids"]


def test_two_hundred_concurrent_requests(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            async def one(i):
                r = await client.post("/generate", json={
                    "input_ids": [10 + i % 50, 11, 12 + i % 7],
                    "sampling_params": {"max_new_tokens": 4 + i % 13, "ignore_eos": True}})
                return r.status_code, r.json()
            return await asyncio.gather(*(one(i) for i in range(200)))
    results = asyncio.run(main())
    assert all(code == 200 for code, _ in results)
    assert [o["meta_info"]["completion_tokens"] for _, o in results] == [4 + i % 13 for i in range(200)]


@pytest.mark.parametrize("body, field", [
    ("{not json", "malformed JSON"),
    ({"text": 5}, "text"),
    ({"input_ids": "abc"}, "input_ids"),
    ({"sampling_params": {"max_new_tokens": 4}}, "'text' or 'input_ids'"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": 10 ** 9}}, "max_new_tokens"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": "ten"}}, "max_new_tokens"),
    ({"input_ids": list(range(5, 1500))}, "context length"),
    ({"input_ids": [1, 2, 99999]}, "outside the vocabulary"),
    ({"input_ids": [1, -3]}, "outside the vocabulary"),
    ({"text": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "hi", "sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "hi", "return_logprob": "yes"}, "return_logprob"),
    ({"text": "hi", "kv_policy": "stale"}, "kv_policy"),
])
def test_bad_input_is_refused_with_the_field_named(server, body, field):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.url}/generate", content=content, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500
    assert field in r.json()["error"], r.json()
    ok = generate(server, input_ids=[1, 2], sampling_params={"max_new_tokens": 2, "ignore_eos": True})
    assert ok["meta_info"]["completion_tokens"] == 2


def test_info_endpoints_and_metrics(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/health_generate").status_code == 200
    assert httpx.get(f"{server.url}/get_model_info").json()["is_generation"] is True
    assert httpx.get(f"{server.url}/get_weight_version").json() == {"weight_version": "0"}
    assert httpx.post(f"{server.url}/flush_cache").json()["success"]
    text = httpx.get(f"{server.url}/metrics").text
    assert "riptide_generation_tokens_total" in text and "riptide_num_running_reqs" in text


def test_openai_endpoints(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "logprobs": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["role"] == "assistant" and len(choice["logprobs"]["content"]) <= 5
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={"prompt": "12 +", "max_tokens": 4, "n": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert r.json()["usage"]["completion_tokens"] <= 8


def test_the_official_openai_client_streams_and_sees_what_riptide_serves(server):
    """The `openai` package against both endpoints: streaming (text, usage), /v1/models, n, stop,
    logprobs with top_logprobs, list-style content, per-token weight versions as an extra field,
    and a 400 naming each field Riptide does not implement."""
    import openai
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60, max_retries=0)
    model = client.models.list().data[0]
    assert model.id and model.max_model_len == 1024

    chunks = list(client.completions.create(model=model.id, prompt="12 +", max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}, seed=3, temperature=1.0))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    whole = client.completions.create(model=model.id, prompt="12 +", max_tokens=6, seed=3, temperature=1.0)
    assert text == whole.choices[0].text and finish == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    versions = [v for c in chunks if c.choices for v in c.choices[0].model_extra["weight_versions"]]
    assert len(versions) == whole.usage.completion_tokens and versions == whole.choices[0].model_extra["weight_versions"]

    stream = client.chat.completions.create(
        model=model.id, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], max_tokens=5,
        stream=True, logprobs=True, top_logprobs=3, n=2)
    by_choice: dict[int, list] = {}
    for c in stream:
        for ch in c.choices:
            by_choice.setdefault(ch.index, []).append(ch)
    assert sorted(by_choice) == [0, 1]
    for parts in by_choice.values():
        assert parts[0].delta.role == "assistant" and parts[-1].finish_reason in ("stop", "length")
        tokens = [t for p in parts if p.logprobs for t in p.logprobs.content]
        assert tokens and all(len(t.top_logprobs) == 3 for t in tokens)
        assert all(t.top_logprobs[0].logprob >= t.logprob - 1e-5 for t in tokens)    # the most likely first

    full = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, n=3, stop=["\n"], temperature=1.0)
    assert len(full.choices) == 3 and all("\n" not in c.message.content for c in full.choices)

    for bad in ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
                {"presence_penalty": 0.5}, {"logit_bias": {"5": 1}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, **bad)
        assert next(iter(bad)) in str(e.value)
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        client.completions.create(model=model.id, prompt="1", max_tokens=2, frequency_penalty=1.0)


def test_reload_from_disk_bumps_version_and_keeps_requests(tiny_model, tiny_model_v2, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    srv = start_server(tiny_model, tmp_path_factory)
    try:
        req = LongRequest(srv, "in-flight")
        r = httpx.post(f"{srv.url}/update_weights_from_disk", timeout=60,
                       json={"model_path": tiny_model_v2, "weight_version": 5})
        assert r.status_code == 200 and r.json()["weight_version"] == "5", r.text
        out = req.finish()
        versions = out["meta_info"]["output_token_versions"]
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert versions[0] == 0 and versions[-1] == 5 and sorted(versions) == versions
        assert httpx.get(f"{srv.url}/get_weight_version").json()["weight_version"] == "5"
        out = generate(srv, input_ids=[21, 22, 23], sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                                     "ignore_eos": True})
        assert out["meta_info"]["output_token_versions"] == [5] * 12
        new = AutoModelForCausalLM.from_pretrained(tiny_model_v2, dtype="float32").eval()
        ref = new.generate(torch.tensor([[21, 22, 23]]), max_new_tokens=12, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, 3:].tolist()
        assert out["output_ids"] == ref
        bad = httpx.post(f"{srv.url}/update_weights_from_disk", json={"model_path": "/nonexistent"})
        assert bad.status_code == 400 and "model_path" in bad.json()["error"]
        assert httpx.get(f"{srv.url}/get_weight_version").json()["weight_version"] == "5"
    finally:
        srv.stop()


def test_api_key_guards_every_endpoint_but_health(tiny_model, tmp_path_factory):
    from inference_server.process import ServerProcess
    srv = ServerProcess(tiny_model, args=["--context-length", "1024"], api_key="s3cret",
                        log_path=tmp_path_factory.mktemp("logs") / "server.log").start()
    try:
        assert "s3cret" not in " ".join(srv.proc.args), "the token is not on the command line"
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert httpx.get(f"{srv.url}/get_model_info").status_code == 401
        assert httpx.get(f"{srv.url}/progress").status_code == 401
        assert httpx.post(f"{srv.url}/weight_sync/open", json={}).status_code == 401
        assert httpx.post(f"{srv.url}/generate", json={"text": "hi"}).status_code == 401
        ok = httpx.post(f"{srv.url}/generate", headers={"Authorization": "Bearer s3cret"},
                        json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert ok.status_code == 200
    finally:
        srv.stop()


def test_every_endpoint_but_health_refused_off_loopback_without_key(tiny_model):
    from fastapi.testclient import TestClient

    from inference_server.engine import Engine, EngineArgs
    from inference_server.http_server import create_app
    app = create_app(Engine(EngineArgs(tiny_model, context_length=256)), tiny_model, host="0.0.0.0")
    with TestClient(app) as client:   # in-process: binds no port
        r = client.post("/update_weights_from_disk", json={"model_path": tiny_model})
        assert r.status_code == 403 and "RIPTIDE_API_KEY" in r.json()["error"]
        assert client.post("/pause_generation", json={"mode": "abort"}).status_code == 403
        assert client.post("/generate", json={"text": "hi"}).status_code == 403
        assert client.get("/health").status_code == 200


def test_the_launcher_refuses_to_serve_off_loopback_without_a_key(tiny_model, monkeypatch):
    from inference_server.launch import parse_args
    monkeypatch.delenv("RIPTIDE_API_KEY", raising=False)
    with pytest.raises(SystemExit):
        parse_args(["--model-path", tiny_model, "--host", "0.0.0.0"])
    monkeypatch.setenv("RIPTIDE_API_KEY", "s3cret")
    assert parse_args(["--model-path", tiny_model, "--host", "0.0.0.0"]).api_key == "s3cret"
