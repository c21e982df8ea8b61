"""Weight sync from an FSDP2 trainer: two real ranks (torch.distributed, gloo, CPU) shard a model
with fully_shard and push it into a real server with push_sharded (tests/sharded_worker.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from platforms.process import free_port
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


def test_a_direct_sharded_push_down_a_chain_is_written_once_and_relayed(target, tiny_model, tmp_path,
                                                                        tmp_path_factory):
    """Topology chain over 3 servers: the ranks write each bucket into the first server only (the
    trainer's egress is the model's size once, split over the ranks), which verifies every rank's
    ranges and relays it on; every server ends on the gathered weights."""
    others = [start_server(tiny_model, tmp_path_factory) for _ in range(2)]
    try:
        urls = [target.url] + [s.url for s in others]
        version = max(served(u)[0] for u in urls) + 1
        rank0, rank1 = run_ranks(tiny_model, ",".join(urls), version, tmp_path / "chain.json", "--topology", "chain")
        assert rank0["ok"] and rank1["ok"], (rank0, rank1)
        assert sum(rank0["egress_by_rank"]) == rank0["bytes"] and min(rank0["egress_by_rank"]) > 0
        assert rank0["peak_gathered_bytes"] == 0
        assert [served(u) for u in urls] == [(version, rank0["digest"])] * 3
    finally:
        for s in others:
            s.stop()


def test_sharded_delta_pushes_send_each_ranks_changed_rows_and_serve_the_gathered_weights(tiny_model, tmp_path,
                                                                                      tmp_path_factory):
    """Delta sync from two FSDP2 ranks into two servers: after the first (whole) push, each rank diffs
    the rows it holds against what it last pushed and sends only the changes; both servers end
    bit-identical to the gathered weights."""
    servers = [start_server(tiny_model, tmp_path_factory) for _ in range(2)]
    try:
        urls = [s.url for s in servers]
        version = max(served(u)[0] for u in urls) + 1
        rank0, rank1 = run_ranks(tiny_model, ",".join(urls), version, tmp_path / "delta.json", "--delta-steps", "3")
        assert rank0["ok"] and rank1["ok"], (rank0, rank1)
        assert [p["modes"] for p in rank0["pushes"]] == [["delta"]] * 3 == [p["modes"] for p in rank1["pushes"]]
        for p in rank0["pushes"]:
            assert 0.01 < p["changed_fraction"] < 0.05 and p["wire_fraction"] < 0.2, p
        assert [served(u) for u in urls] == [(version + 3, rank0["digest"])] * 2
    finally:
        for s in servers:
            s.stop()


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


TRAINER = Path(__file__).resolve().parent / "trainer_worker.py"


def train_ranks(world: int, tiny_model: str, ckpt: Path, steps: int, resume: Path | None = None) -> dict:
    """The built-in trainer on `world` real ranks (tests/trainer_worker.py): rank 0's metrics."""
    out = ckpt.parent / f"{ckpt.name}.json"
    cmd = [sys.executable, str(TRAINER), tiny_model, str(ckpt), str(steps), str(out)] + \
        (["--resume", str(resume)] if resume else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(world)}
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(world)]
    try:
        assert [p.wait(240) for p in procs] == [0] * world
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return json.loads(out.read_text())


def weights(checkpoint: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(checkpoint / "model.safetensors"))


def assert_same_update(before: Path, a: Path, b: Path) -> None:
    """a and b moved every tensor from `before` by the same update, up to the order of float sums
    (ranks add partial gradients; Adam magnifies a near-zero gradient's noise): each tensor's two
    updates differ by under 0.1% of its size (2-rank runs: under 0.007%)."""
    w0, wa, wb = weights(before), weights(a), weights(b)
    assert w0.keys() == wa.keys() == wb.keys()
    for name in w0:
        da, db = wa[name] - w0[name], wb[name] - w0[name]
        assert da.norm() > 0, name
        assert (da - db).norm() <= 1e-3 * da.norm(), (name, float((da - db).norm() / da.norm()))


def test_the_built_in_trainer_on_two_ranks_makes_the_one_rank_update_and_resumes_across_world_sizes(
        tiny_model, tmp_path):
    """trainer.world_size=2: FSDP2 over 2 gloo ranks, rows dealt unequally (11 rows, mini-batches
    of 6 and 5, micro-batches of 2: one rank runs a stand-in micro-batch). Two steps of 2 updates
    each land on the weights one rank makes on the same batch, and report the same metrics; a
    checkpoint of either resumes on the other world size with its optimizer state: a third step
    from there matches a third step of the one-rank run."""
    one = train_ranks(1, tiny_model, tmp_path / "one", 2)
    two = train_ranks(2, tiny_model, tmp_path / "two", 2)
    assert (one["world"], two["world"]) == (1, 2)
    step = "step-000002"
    assert_same_update(Path(tiny_model), tmp_path / "one" / step, tmp_path / "two" / step)
    assert (tmp_path / "two" / step / "sharded").is_dir()           # the sharded state, beside the HF weights
    for m1, m2 in zip(one["metrics"], two["metrics"]):
        assert m2["optimizer_steps"] == m1["optimizer_steps"] == 2
        for key in ("loss", "entropy", "grad_norm", "clip_fraction_low", "clip_fraction_high",
                    "logprob_mean_abs_diff"):
            assert abs(m1[key] - m2[key]) <= 1e-4 * max(1.0, abs(m1[key])), (key, m1[key], m2[key])
    assert any(m["clip_fraction_high"] + m["clip_fraction_low"] > 0 for m in one["metrics"])   # the clip acted
    # resume: 1 -> 1 is the reference; 1 -> 2 and 2 -> 1 must land on it (Adam's moments came along)
    train_ranks(1, tiny_model, tmp_path / "ref", 1, resume=tmp_path / "one" / step)
    train_ranks(2, tiny_model, tmp_path / "up", 1, resume=tmp_path / "one" / step)
    train_ranks(1, tiny_model, tmp_path / "down", 1, resume=tmp_path / "two" / step)
    assert_same_update(tmp_path / "one" / step, tmp_path / "ref" / "step-000003", tmp_path / "up" / "step-000003")
    assert_same_update(tmp_path / "two" / step, tmp_path / "ref" / "step-000003", tmp_path / "down" / "step-000003")
