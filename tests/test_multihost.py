"""A job across real hosts: three network namespaces with their own addresses (tests/hosts.py), Ray
started in each with the `ray` command as the README says, the checkpoint and the run directory only
on the trainer's host. Skipped with the reason where the machine refuses namespaces."""
import json
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.hosts import Hosts, namespaces_refused
from trainer_bridge.job.monitor import read_rows

pytestmark = pytest.mark.skipif(namespaces_refused() is not None, reason=namespaces_refused() or "")

BIN = Path(sys.executable).parent
HEAD_PORT = 6379
# conftest keeps loopback test clusters on 127.0.0.1 with this; hosts with addresses of their own need Ray's
# default. Ray's token auth on, with one token shared by every node and the job, as the README says.
# Trainer ranks meet over gloo on the hosts' own interface (eth0 in tests/hosts.py).
REAL = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "GLOO_SOCKET_IFNAME": "eth0"}


def wait_for(what: str, check, timeout_s: float, every_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = check()
        if out:
            return out
        time.sleep(every_s)
    raise TimeoutError(f"{what} within {timeout_s}s")


class RayHosts:
    """Host 0 (the trainer's) is the head with no CPUs for actors; every other host a worker with
    one CPU (one server each). Started with `ray start --block`, so the harness owns the processes."""

    def __init__(self, hosts: Hosts, logs: Path):
        self.hosts, self.head = hosts, f"{hosts[0].addr}:{HEAD_PORT}"
        common = ["--block", "--disable-usage-stats"]
        hosts[0].run([str(BIN / "ray"), "start", "--head", f"--port={HEAD_PORT}", f"--node-ip-address={hosts[0].addr}",
                      "--num-cpus=0", "--include-dashboard=false", *common], env=REAL, log_path=str(logs / "ray-head.log"))
        wait_for("the head answers", lambda: self._nodes() >= 1, 90)
        for i, h in enumerate(hosts.hosts[1:], 1):
            h.run([str(BIN / "ray"), "start", f"--address={self.head}", f"--node-ip-address={h.addr}",
                   "--num-cpus=1", *common], env=REAL, log_path=str(logs / f"ray-worker{i}.log"))
        wait_for(f"{len(hosts)} Ray nodes", lambda: self._nodes() >= len(hosts), 120)

    def _nodes(self) -> int:
        code = (f"import ray; ray.init(address='{self.head}', log_to_driver=False); "
                f"print(sum(n['Alive'] for n in ray.nodes()))")
        try:
            out = self.hosts[0].check_output([sys.executable, "-c", code], timeout=60, env=REAL)
            return int(out.strip().splitlines()[-1])
        except Exception:       # noqa: BLE001  not up yet
            return 0


@pytest.fixture(scope="module")
def ray_hosts(tmp_path_factory):
    """3 hosts; `data` holds the model and the runs, seen by host 0 only."""
    data = tmp_path_factory.mktemp("hostdata")
    logs = tmp_path_factory.mktemp("hostlogs")
    # each host its own /tmp/ray (Ray's sockets and session) and /dev/shm (its object store), as real hosts have
    with Hosts(3, private_dirs=[str(data), "/tmp/ray", "/dev/shm"]) as hosts:
        hosts[0].private_dirs = ["/tmp/ray", "/dev/shm"]    # the trainer's host has the checkpoint
        yield RayHosts(hosts, logs), hosts, data, logs


def server_urls(run_dir: Path) -> list[str]:
    """The servers a running job uses, from its metrics rows (fleet/tokens_per_s/<host:port>)."""
    urls = set()
    for row in read_rows(run_dir / "metrics.jsonl"):
        urls |= {k.split("/", 2)[2] for k in row if k.startswith("fleet/tokens_per_s/")}
    return sorted(f"http://{u}" for u in urls)


def server_urls_of(row: dict) -> list[str]:
    return [f"http://{k.split('/', 2)[2]}" for k in row if k.startswith("fleet/tokens_per_s/")]


# A stranger on the network: started before the job with httpx imported, it waits for the servers' URLs on
# stdin and then asks each for /generate (no key) and /health at once, so it asks while the job still runs.
STRANGER = """
import json, sys, httpx
from concurrent.futures import ThreadPoolExecutor
print("ready", flush=True)
urls = json.loads(sys.stdin.readline())
asks = [(u, p) for u in urls for p in ("/generate", "/health")]
def ask(a):
    u, p = a
    return httpx.request("GET" if p == "/health" else "POST", u + p, json={"text": "hi"}, timeout=20).status_code
with ThreadPoolExecutor(len(asks)) as pool:
    codes = list(pool.map(ask, asks))
print(json.dumps({u: [codes[2 * i], codes[2 * i + 1]] for i, u in enumerate(urls)}), flush=True)
"""


def start_stranger(host) -> subprocess.Popen:
    """The stranger on `host`, ready for its URLs (one JSON line on stdin); killed by the hosts' close()."""
    proc = subprocess.Popen(host.command([sys.executable, "-c", STRANGER]), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    host.procs.append(proc)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def stranger_statuses(proc: subprocess.Popen, urls: list[str]) -> dict[str, tuple[int, int]]:
    out, _ = proc.communicate(json.dumps(urls) + "\n", timeout=60)
    return {u: tuple(s) for u, s in json.loads(out.strip().splitlines()[-1]).items()}


def test_a_job_across_three_hosts_with_the_model_only_on_the_trainers(ray_hosts):
    """The README's command in the head host: 2 servers on 2 other hosts that cannot read
    model.path get the config and tokenizer from the job and the weights by its push; a stranger on
    the network is refused; checkpoints and metrics are on the trainer's host."""
    cluster, hosts, data, logs = ray_hosts
    run_dir = data / "run-basic"
    assert hosts[1].check_output(["ls", "-A", str(data)]) == "", "a server's host sees none of the trainer's files"
    stranger = start_stranger(hosts[2])
    job = hosts[0].run([str(BIN / "riptide-train"), "cluster=ray", f"cluster.address={cluster.head}",
                        "server.num_servers=2", "trainer.steps=16", "trainer.checkpoint_every=8", "logger.wandb=false",
                        f"model.path={data}/model", f"run_dir={run_dir}", "logger.progress=false"],
                       env=REAL, log_path=str(logs / "job-basic.log"), cwd=str(data))
    try:
        urls = wait_for("the first metrics row", lambda: server_urls(run_dir), 300, every_s=0.1)
        stranger = stranger_statuses(stranger, urls)
        assert job.wait(timeout=600) == 0, (logs / "job-basic.log").read_text()[-3000:]
    finally:
        hosts[0].stop(job)
    summary = json.loads((logs / "job-basic.log").read_text().strip().splitlines()[-1])
    assert summary["steps"] == 16
    assert {u.split("//")[1].split(":")[0] for u in urls} == {hosts[1].addr, hosts[2].addr}
    assert all(s == (401, 200) for s in stranger.values()), stranger
    assert (run_dir / "checkpoints").is_dir() and sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    config = (run_dir / "config.yaml").read_text()
    assert "api_key: ''" in config or "<redacted>" in config


def test_two_trainer_ranks_across_hosts_save_and_resume(ray_hosts):
    """trainer.world_size=2: rank 1 is a Ray actor on a host that sees neither model.path nor
    run_dir. It builds the model from the config rank 0 sends and takes rank 0's weights; it pushes
    its own shard into the server; checkpoints are gathered to rank 0's host (the ranks share no
    filesystem), and the job resumes from one on two ranks again."""
    import torch
    cluster, hosts, data, logs = ray_hosts
    run_dir = data / "run-ranks"
    job = [str(BIN / "riptide-train"), "cluster=ray", f"cluster.address={cluster.head}", "server.num_servers=1",
           "trainer.world_size=2", "trainer.checkpoint_every=2", "logger.wandb=false", "logger.progress=false",
           f"model.path={data}/model", f"run_dir={run_dir}"]
    for i, extra in enumerate((["trainer.steps=4"], ["trainer.steps=6", "trainer.resume=latest"])):
        log = logs / f"job-ranks{i}.log"
        proc = hosts[0].run(job + extra, env=REAL, log_path=str(log), cwd=str(data))
        try:
            assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
        finally:
            hosts[0].stop(proc)
        if i == 0:
            state = torch.load(run_dir / "checkpoints" / "step-000004" / "trainer_state.pt", weights_only=False)
            assert "optimizer_by_name" in state, "no shared filesystem: the optimizer is gathered to rank 0"
    summary = json.loads(log.read_text().strip().splitlines()[-1])
    assert summary["first_step"] == 4 and summary["steps"] == 6
    steps = [r["step"] for r in rows(run_dir)]
    assert steps == list(range(6)), steps
    assert rows(run_dir)[-1]["sync/egress_bytes/rank1"] > 0, "rank 1 wrote its own shard from its host"


def rows(run_dir: Path) -> list[dict]:
    return read_rows(run_dir / "metrics.jsonl")  # the job may be writing it


def answers(host, url: str) -> bool:
    code = (f"import httpx\ntry:\n    httpx.get('{url}/health', timeout=3); print(1)\n"
            f"except httpx.HTTPError:\n    print(0)")
    return host.check_output([sys.executable, "-c", code], timeout=30).strip().endswith("1")


@pytest.fixture
def four_hosts(tmp_path_factory):
    """The trainer's host and three server hosts (two serve, one is room for a replacement); anew
    for each test, since a host whose link was cut loses its Ray node."""
    data, logs = tmp_path_factory.mktemp("hostdata4"), tmp_path_factory.mktemp("hostlogs4")
    with Hosts(4, prefix="rq", private_dirs=[str(data), "/tmp/ray", "/dev/shm"]) as hosts:
        hosts[0].private_dirs = ["/tmp/ray", "/dev/shm"]
        yield RayHosts(hosts, logs), hosts, data, logs


def test_a_link_cut_mid_rollout_evicts_the_server_and_its_replacement_serves(four_hosts):
    """A server's host loses its link while it generates: the router marks it down within
    progress_timeout_s and its requests move; the next push leaves it out (evicted, no hop timeout
    waited); a replacement starts on the spare host from a live peer and takes requests; the job
    completes every step. The link comes back: the evicted server never serves again."""
    cluster, hosts, data, logs = four_hosts
    run_dir, log = data / "run-cut", logs / "job-cut.log"
    job = hosts[0].run([str(BIN / "riptide-train"), "cluster=ray", f"cluster.address={cluster.head}",
                        "server.num_servers=2", "trainer.steps=60", "logger.wandb=false", "logger.progress=false",
                        "weight_sync.timeout_s=10", f"model.path={data}/model", f"run_dir={run_dir}"],
                       env=REAL, log_path=str(log), cwd=str(data))
    try:
        wait_for("two metrics rows", lambda: len(rows(run_dir)) >= 2, 300, every_s=0.2)
        urls = server_urls(run_dir)
        victim_url = urls[1]
        victim = next(h for h in hosts if victim_url.split("//")[1].startswith(h.addr + ":"))
        cut_at = time.time()
        victim.cut()
        evicted = wait_for("an eviction", lambda: [r for r in rows(run_dir) if r["fleet/evictions"]], 120, 0.2)[0]
        victim.restore()
        restored_at = time.time()
        joined = wait_for("a replacement", lambda: [r for r in rows(run_dir) if r["fleet/replacements"]], 180, 0.2)[0]
        gone = wait_for("the evicted server gone", lambda: not answers(hosts[0], victim_url), 120, 1.0)
        gone_s = time.time() - restored_at
        assert job.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        hosts[0].stop(job)
    summary = json.loads(log.read_text().strip().splitlines()[-1])
    last = rows(run_dir)[-1]
    evict_s, serve_s = evicted["fleet/last_eviction_at"] - cut_at, joined["fleet/last_join_at"] - cut_at
    print(f"link cut -> evicted {evict_s:.1f} s, -> replacement serving {serve_s:.1f} s; "
          f"link restored -> evicted server gone {gone_s:.1f} s")
    assert summary["steps"] == 60 and gone
    assert last["fleet/servers"] == 2 and victim_url not in server_urls_of(last)
    assert evict_s < 60 and serve_s < 120


def in_push(host, url: str, token: str, timeout_s: float) -> None:
    """Return once the server at `url` has an update open (a push under way)."""
    code = (f"import httpx, time\nend = time.monotonic() + {timeout_s}\n"
            f"while time.monotonic() < end:\n"
            f"    s = httpx.get('{url}/weight_sync/status', headers={{'Authorization': 'Bearer {token}'}}, timeout=5).json()\n"
            f"    if s['stage'] in ('open', 'staged'):\n        print('in push', s); break\n"
            f"    time.sleep(0.05)\nelse:\n    raise SystemExit('no push seen')")
    host.check_output([sys.executable, "-c", code], timeout=timeout_s + 30)


def test_a_link_cut_mid_push_to_the_relaying_server(four_hosts):
    """Tree topology: the trainer writes each bucket to the first server, which relays it to the
    second. The first server's link (capped so a push takes seconds) is cut while a push is under
    way: the push drops it within the hop timeout, naming it, feeds the second server itself and
    commits there; the first is evicted and replaced; the job completes."""
    cluster, hosts, data, logs = four_hosts
    run_dir, log, token = data / "run-push", logs / "job-push.log", secrets.token_urlsafe(16)
    job = hosts[0].run([str(BIN / "riptide-train"), "cluster=ray", f"cluster.address={cluster.head}",
                        "server.num_servers=2", "trainer.steps=60", "logger.wandb=false", "logger.progress=false",
                        "weight_sync.timeout_s=10", "weight_sync.topology=tree", "weight_sync.bucket_mb=1",
                        f"model.path={data}/model", f"run_dir={run_dir}"],
                       env={**REAL, "RIPTIDE_API_KEY": token}, log_path=str(log), cwd=str(data))
    try:
        wait_for("two metrics rows", lambda: len(rows(run_dir)) >= 2, 300, every_s=0.2)
        relay_url = server_urls(run_dir)[0]
        relay = next(h for h in hosts if relay_url.split("//")[1].startswith(h.addr + ":"))
        relay.cap(2)                       # ~1.5 MB a push: several seconds on this link
        in_push(hosts[0], relay_url, token, 120)
        cut_at = time.time()
        relay.cut()
        evicted = wait_for("an eviction", lambda: [r for r in rows(run_dir) if r["fleet/evictions"]], 120, 0.2)[0]
        joined = wait_for("a replacement", lambda: [r for r in rows(run_dir) if r["fleet/replacements"]], 180, 0.2)[0]
        assert job.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        hosts[0].stop(job)
    text = log.read_text()
    evict_s, serve_s = evicted["fleet/last_eviction_at"] - cut_at, joined["fleet/last_join_at"] - cut_at
    print(f"link cut mid-push -> evicted {evict_s:.1f} s, -> replacement serving {serve_s:.1f} s")
    assert f"dropping {relay_url}" in text, "the push names the server it dropped"
    assert json.loads(text.strip().splitlines()[-1])["steps"] == 60
    assert evict_s < 60 and relay_url not in server_urls_of(rows(run_dir)[-1])


def test_a_link_cut_at_commit(ray_hosts, tmp_path_factory):
    """Two servers on two hosts; the second's link is cut once it has prepared, before the commit
    reaches it: the push reports the version committed (every server prepared) with that server
    pending; it keeps serving the old version while cut off, and once the link is back it learns
    the outcome and commits the same weights, never anything else."""
    _, hosts, _, logs = ray_hosts
    from inference_server.tiny_model import build_tiny_model
    model = str(build_tiny_model(tmp_path_factory.mktemp("commit") / "model", hidden=64, layers=2, heads=4,
                                 kv_heads=2, tokenizer="chars", max_positions=256))     # seen by every host
    token = secrets.token_urlsafe(16)
    urls, procs = [], []
    for h in hosts.hosts[1:]:
        procs.append(h.run([sys.executable, "-m", "inference_server", "--model-path", model, "--host", h.addr,
                            "--port", "30100", "--context-length", "128", "--cpu-threads", "1", "--no-cpu-split"],
                           env={"RIPTIDE_API_KEY": token}, log_path=str(logs / f"commit-server-{h.name}.log")))
        urls.append(f"http://{h.addr}:30100")
    code = (f"import httpx, time\nfor u in {urls!r}:\n    end = time.monotonic() + 120\n"
            f"    while time.monotonic() < end:\n        try:\n"
            f"            if httpx.get(u + '/health', timeout=2).status_code == 200: break\n"
            f"        except httpx.HTTPError: pass\n        time.sleep(0.3)\n")
    try:
        hosts[0].check_output([sys.executable, "-c", code], timeout=180)
        out = hosts[0].check_output([sys.executable, str(Path(__file__).parent / "commit_cut_worker.py"), model,
                                     *urls, hosts[2].name, hosts[0].addr], timeout=300,
                                    env={"RIPTIDE_API_KEY": token, "PYTHONPATH": str(Path(__file__).parents[1])})
    finally:
        # the worker brings the link back; a failure half way must not leave it cut
        subprocess.run(["ip", "-n", hosts[2].name, "link", "set", "eth0", "up"], check=False)
        for h, p in zip(hosts.hosts[1:], procs):
            h.stop(p)
    result = json.loads(out.strip().splitlines()[-1])
    print(f"link cut at commit: {result['push']}; after the link came back the cut server served "
          f"{result['b_versions_after_restore']} and committed in {result['b_committed_after_s']} s")
    assert result["push"]["committed_everywhere"] is False and result["push"]["pending"] == [urls[1]]
    assert result["push"]["serving"][urls[0]] == 1
    assert set(result["b_versions_after_restore"]) <= {0, 1} and result["b_versions_after_restore"][-1] == 1
    assert result["digests"][0] == result["digests"][1]
