"""Weight sync from an FSDP2 trainer: two real ranks (torch.distributed, gloo, CPU) shard a model
with fully_shard and push it into a real server with push_sharded (tests/sharded_worker.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from inference_server.process import free_port
from tests.conftest import start_server

pytestmark = pytest.mark.slow
WORKER = Path(__file__).resolve().parent / "sharded_worker.py"


def run_ranks(model_path: str, url: str, version: int, out: Path, *extra: str, timeout: float = 240) -> list:
    """Both ranks as processes (torchrun's environment); each one's result, None for a rank that
    left none (it died)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), model_path, url, str(version), str(out), *extra],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    try:
        for p in procs:
            p.wait(timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads(f.read_text()) if (f := Path(f"{out}.rank{r}")).exists() else None for r in range(2)]


def greedy(url, prompt=(21, 22, 23), n=12):
    r = httpx.post(f"{url}/generate", timeout=60, json={
        "input_ids": list(prompt), "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def served(url) -> tuple[int, str]:
    version = int(httpx.get(f"{url}/get_weight_version").json()["weight_version"])
    return version, httpx.get(f"{url}/weight_sync/digest", timeout=60).json()["digest"]


@pytest.fixture(scope="module")
def target(tiny_model, tmp_path_factory):
    srv = start_server(tiny_model, tmp_path_factory)
    yield srv
    srv.stop()


@pytest.mark.parametrize("mode", ["direct", "gather"])
def test_an_fsdp2_models_push_serves_the_gathered_weights(mode, target, tiny_model, tmp_path, tmp_path_factory):
    version = served(target.url)[0] + 1
    rank0, rank1 = run_ranks(tiny_model, target.url, version, tmp_path / "push.json", "--mode", mode)
    assert rank0["ok"] and rank1["ok"], (rank0, rank1)
    assert rank0["buckets"] > 1
    if mode == "direct":     # each rank wrote its own shard: every byte once, by one of them, nothing gathered
        assert rank0["peak_gathered_bytes"] == rank1["peak_gathered_bytes"] == 0
        assert sum(rank0["egress_by_rank"]) == rank0["bytes"] and min(rank0["egress_by_rank"]) > 0
    else:                    # gathered a bucket at a time (the embedding, larger than a bucket, is the most)
        assert 0 < rank0["peak_gathered_bytes"] < rank0["model_bytes"] / 2
    assert rank0["digest"] == rank1["digest"]
    assert served(target.url) == (version, rank0["digest"])     # bit-identical to the gathered model
    # and it serves them: the same greedy tokens as a server that loaded them from a checkpoint
    loaded = start_server(rank0["saved"], tmp_path_factory)
    try:
        assert greedy(target.url) == greedy(loaded.url)
    finally:
        loaded.stop()


def test_a_rank_lost_mid_push_leaves_the_old_weights_and_a_retry_commits(target, tiny_model, tmp_path):
    before = served(target.url)
    rank0, rank1 = run_ranks(tiny_model, target.url, before[0] + 1, tmp_path / "lost.json", "--die-at-message", "4")
    assert rank1 is None                                    # it died (os._exit) after writing 2 buckets
    assert rank0 is not None and not rank0["ok"], rank0
    assert served(target.url) == before                     # no torn weights: the old version, whole
    rank0, rank1 = run_ranks(tiny_model, target.url, before[0] + 1, tmp_path / "retry.json")
    assert rank0["ok"] and rank1["ok"], (rank0, rank1)
    assert served(target.url) == (before[0] + 1, rank0["digest"])


def test_the_fsdp_attach_example_runs_under_torchrun(tmp_path):
    from tests.test_trainer_bridge import ROOT, servers_of
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                           str(ROOT / "examples" / "attach_fsdp_trainer.py"), "3"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [line.split(":")[0] for line in proc.stdout.strip().splitlines() if line.startswith("step ")]
    assert steps == ["step 0", "step 1", "step 2"]
    assert servers_of(tmp_path / ".cache") == []
