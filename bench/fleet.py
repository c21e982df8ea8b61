"""A fleet of servers as Ray actors: weight pushes star against relay, and a server's death.

    python bench/fleet.py [--sizes 1,2,4] [--pushes 3] [--hidden 384 --layers 4]

One run, on a real Ray cluster on this machine (ray.cluster_utils.Cluster: a head and 3 worker
nodes of 2 CPUs, all on 127.0.0.1), one tiny random Qwen2 (built into a temp dir).

 (a) Pushes: 4 servers (RayFleet: an actor and a placement group each, 0.5 CPU), then for each N in
     --sizes and each mode, `WeightSync(first N servers).push(weights, v)` --pushes times (one element
     of every tensor nudged before each, so every version differs): star (the trainer writes every
     bucket to every server) and relay (topology tree, fan-out chosen per push: the trainer writes each bucket once,
     servers pass it on). Reported per N and mode: median push seconds, commit seconds, and the
     trainer's egress bytes over the model's bytes (what the trainer itself wrote: star ~N, relay ~1).
     After each mode, every server's live-weight digest must equal the trainer's.
 (b) A death: RolloutBackend(cluster=ray, 2 servers) generating GRPO batches; one server is killed
     (SIGKILL) mid-rollout; the next push drops it (evicted), a replacement starts on a free node,
     cold-starts from the live server and joins. replace_s: from the eviction to the replacement
     taking requests. samples_lost: prompts drawn but neither handed out, nor pending in the manager,
     nor dropped and counted (should be 0); samples_duplicated: sample ids handed out twice.

Logs go to stderr; the last line is one JSON object: relay_egress_ratio_n4, star_egress_ratio_n4,
push_s ({mode: {N: seconds}}), commit_s, egress_ratio, replace_s, samples_lost, samples_duplicated.

    python bench/fleet.py --hosts [--rate-mbit 100] [--sizes 1,2,4] [--pushes 3]

The relay fan-out physically: hosts with their own addresses and links (network namespaces on a
bridge, tests/hosts.py; needs root), the trainer on one, a server on each of 4 others
(riptide-serve with a bearer token), every host's link capped at --rate-mbit in both directions
(tc tbf). The pushes run on the trainer's host: for each N and topology (star; tree with the
fan-out it chooses per push, the default; chain; tree with fan-out 2 fixed), the median push time of
--pushes pushes, the model verified on every server after each topology. Printed:
hosts_star_push_ratio_n4, hosts_tree_push_ratio_n4, hosts_chain_push_ratio_n4,
hosts_tree_f2_push_ratio_n4 (push seconds at 4 servers over 1), push_s per topology and N,
rate_mbit, model_bytes, verified.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # read by Ray at import: nodes stay on 127.0.0.1


def log(msg: str) -> None:
    print(f"[fleet {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ray_cluster():
    import ray
    from ray.cluster_utils import Cluster
    small = dict(node_ip_address="127.0.0.1", object_store_memory=100 << 20)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False, **small})
    for _ in range(3):
        c.add_node(num_cpus=2, **small)
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    return c


def configs(model_path: str, address: str, n: int = 2, topology: str = "tree"):
    from rollout.config import RolloutConfig
    from trainer_bridge.backend import BackendConfig
    from trainer_bridge.config import ClusterConfig, ServerConfig, TaskConfig, WeightSyncConfig
    return BackendConfig(model_path=model_path, task=TaskConfig(name="copy", num_digits=2),
                         rollout=RolloutConfig(group_size=4, batch_size=4, max_new_tokens=32, ignore_eos=True,
                                               max_staleness=2, progress_timeout_s=5),
                         server=ServerConfig(num_servers=n, context_length=256, device="cpu", dtype="float32"),
                         weight_sync=WeightSyncConfig(bucket_mb=8, timeout_s=10, topology=topology),
                         cluster=ClusterConfig(kind="ray", address=address, server_cpus=0.5))


def pushes(cfg, model, sizes: list[int], count: int) -> dict:
    import torch

    from trainer_bridge.fleets.ray_cluster import RayFleet
    from weight_sync import live_digest, named_weights
    from weight_sync.sender import WeightSync
    fleet = RayFleet(cfg.model_path, cfg.server, cfg.weight_sync, cfg.cluster)
    urls = fleet.launch(max(sizes), 0)
    params = named_weights(model)
    nbytes = sum(t.nbytes for t in params.values())
    out = {"model_bytes": nbytes, "push_s": {}, "commit_s": {}, "egress_ratio": {}, "verified": True}
    version = 0
    try:
        for mode, topology in (("star", "star"), ("relay", "tree")):
            for n in sizes:
                sync = WeightSync(urls[:n], bucket_bytes=cfg.weight_sync.bucket_mb << 20, timeout_s=30,
                                  topology=topology, host=fleet.host)
                runs = []
                try:
                    for _ in range(count + 1):             # the first allocates slots and shadows: untimed
                        with torch.no_grad():
                            for t in params.values():
                                t.view(-1)[version % t.numel()] += 1e-3
                        version += 1
                        runs.append(sync.push(params, version))
                finally:
                    sync.close()
                timed = runs[1:]
                out["push_s"].setdefault(mode, {})[n] = round(statistics.median(s.seconds for s in timed), 3)
                out["commit_s"].setdefault(mode, {})[n] = round(statistics.median(s.commit_s for s in timed), 4)
                out["egress_ratio"].setdefault(mode, {})[n] = round(statistics.median(s.egress_bytes for s in timed) / nbytes, 3)
                log(f"{mode} N={n}: push {out['push_s'][mode][n]} s, egress {out['egress_ratio'][mode][n]} x model")
                import httpx
                want = live_digest(params)
                got = [httpx.get(f"{u}/weight_sync/digest", timeout=60).json()["digest"] for u in urls[:n]]
                out["verified"] &= all(g == want for g in got)
    finally:
        fleet.close()
    return out


def death(cfg, model) -> dict:
    import signal

    from trainer_bridge.backend import RolloutBackend
    seen = []
    with RolloutBackend(cfg) as b:
        b.start(model)

        def step():                              # what a trainer does: a batch, then a new version
            seen.extend(b.next_batch(timeout_s=300).samples)
            b.push_weights(model, version=b.version + 1)
        step()
        victim = b.servers[0]
        os.kill(b.fleet.pid(victim), signal.SIGKILL)
        log(f"killed {victim} mid-rollout")
        deadline = time.monotonic() + 300
        while b.stats.replacements < 1 and time.monotonic() < deadline:
            step()                               # the eviction, then the replacement joining, happen here
        step()                                   # the replacement takes requests
        state = b.state_dict()
        replace_s = b.stats.last_replace_s if b.stats.replacements else None
    started = state["data"]["cursor"] + state["data"]["epoch"] * len(b.items)
    groups = {s.group_id for s in seen}
    accounted = len(groups) + len(state["groups"]) + sum(state["metrics"]["drops"].values())
    return {"replace_s": round(replace_s, 2) if replace_s is not None else None,
            "samples_lost": (started - accounted) * cfg.rollout.group_size,
            "samples_duplicated": len(seen) - len({s.uid for s in seen}),
            "evictions": b.stats.evictions}


TOPOLOGIES = {"star": ("star", 0), "tree": ("tree", 0), "chain": ("chain", 0), "tree_f2": ("tree", 2)}


def host_pushes(a, urls: list[str], host: str) -> dict:
    """On the trainer's host (--hosts-driver): every topology and N, timed; digests checked."""
    import httpx
    import torch
    from transformers import AutoModelForCausalLM

    from weight_sync import live_digest, named_weights
    from weight_sync.sender import WeightSync
    token = os.environ["RIPTIDE_API_KEY"]
    params = named_weights(AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32))
    sizes = [int(x) for x in a.sizes.split(",")]
    out = {"model_bytes": sum(t.nbytes for t in params.values()), "push_s": {}, "verified": True}
    version = 0
    for topology, (shape, fan_out) in TOPOLOGIES.items():
        for n in sizes:
            sync = WeightSync(urls[:n], bucket_bytes=a.bucket_mb << 20, num_slots=a.num_slots, timeout_s=60,
                              topology=shape, fan_out=fan_out, host=host, api_key=token)
            runs = []
            try:
                for _ in range(a.pushes + 1):          # the first allocates slots and shadows: untimed
                    with torch.no_grad():
                        for t in params.values():
                            t.view(-1)[version % t.numel()] += 1e-3
                    version += 1
                    runs.append(sync.push(params, version).seconds)
            finally:
                sync.close()
            out["push_s"].setdefault(topology, {})[n] = round(statistics.median(runs[1:]), 3)
            want = live_digest(params)
            got = [httpx.get(f"{u}/weight_sync/digest", timeout=60, headers={"Authorization": f"Bearer {token}"}
                             ).json()["digest"] for u in urls[:n]]
            out["verified"] &= all(g == want for g in got)
            log(f"{topology} N={n}: push {out['push_s'][topology][n]} s, verified {all(g == want for g in got)}")
    return out


def hosts_bench(a) -> dict:
    """Hosts as network namespaces: the trainer on host 0, a server on each other host, links capped."""
    import secrets
    import subprocess

    from tests.hosts import Hosts, namespaces_refused
    refused = namespaces_refused()
    if refused:
        raise SystemExit(f"bench/fleet.py --hosts: {refused}")
    from inference_server.tiny_model import build_tiny_model
    sizes = [int(x) for x in a.sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="riptide_fleet_hosts_"))
    path = str(build_tiny_model(root / "model", hidden=a.hidden, layers=a.layers, heads=6, kv_heads=2,
                                tokenizer="chars", max_positions=512))
    token = secrets.token_urlsafe(24)
    with Hosts(max(sizes) + 1, prefix="rb") as hosts:
        urls = []
        for i, h in enumerate(hosts.hosts[1:]):
            h.run([sys.executable, "-m", "inference_server", "--model-path", path, "--host", h.addr, "--port", "30000",
                   "--context-length", "256", "--cpu-threads", "1", "--no-cpu-split"],
                  env={"RIPTIDE_API_KEY": token}, log_path=str(root / f"server{i}.log"))
            urls.append(f"http://{h.addr}:30000")
        for h in hosts:
            h.cap(a.rate_mbit)
        log(f"{len(urls)} servers on {[h.addr for h in hosts.hosts[1:]]}, links capped at {a.rate_mbit} Mbit/s")
        driver = [sys.executable, str(Path(__file__).resolve()), "--hosts-driver", "--model", path, "--sizes", a.sizes,
                  "--pushes", str(a.pushes), "--host", hosts[0].addr, "--urls", ",".join(urls),
                  "--bucket-mb", str(a.bucket_mb), "--num-slots", str(a.num_slots)]
        try:
            out = hosts[0].check_output(driver, timeout=1800, env={"RIPTIDE_API_KEY": token})
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"the push driver failed: {e.stderr[-3000:]}") from None
    out = json.loads(out.strip().splitlines()[-1])
    big = max(sizes)
    ratios = {f"hosts_{t}_push_ratio_n{big}": round(out["push_s"][t][str(big)] / out["push_s"][t][str(min(sizes))], 3)
              for t in TOPOLOGIES}
    return {**ratios, "rate_mbit": a.rate_mbit, "bucket_mb": a.bucket_mb, "num_slots": a.num_slots, **out}


def wait_served(urls: list[str], timeout_s: float = 180) -> None:
    import httpx
    deadline = time.monotonic() + timeout_s
    for url in urls:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} did not come up within {timeout_s}s")
            time.sleep(0.3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,2,4")
    p.add_argument("--pushes", type=int, default=3)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hosts", action="store_true", help="hosts of their own (network namespaces), links capped")
    p.add_argument("--rate-mbit", type=float, default=100.0,
                   help="--hosts: every host's link, each direction (at 200 the 2-core machine, not the links, "
                        "limits a 4-relay chain: the CPUs sit at 0%% idle)")
    p.add_argument("--bucket-mb", type=int, default=2, help="--hosts: bucket size")
    p.add_argument("--num-slots", type=int, default=4, help="--hosts: staging slots per receiver")
    p.add_argument("--hosts-driver", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--host", help=argparse.SUPPRESS)
    p.add_argument("--urls", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.hosts_driver:
        import logging
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        urls = a.urls.split(",")
        wait_served(urls)
        out = host_pushes(a, urls, a.host)
        sys.stderr.flush()
        print(json.dumps(out), flush=True)
        return
    if a.hosts:
        out = hosts_bench(a)
        sys.stderr.flush()
        print(json.dumps(out), flush=True)
        return
    sizes = [int(x) for x in a.sizes.split(",")]
    if min(sizes) < 1 or max(sizes) > 6:
        p.error(f"--sizes {a.sizes}: between 1 and 6 servers (3 nodes of 2 CPUs, 0.5 CPU a server)")

    import logging

    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from inference_server.tiny_model import build_tiny_model
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    os.environ.setdefault("WANDB_MODE", "disabled")
    root = Path(tempfile.mkdtemp(prefix="riptide_fleet_"))
    path = str(build_tiny_model(root / "model", hidden=a.hidden, layers=a.layers, heads=6, kv_heads=2,
                                tokenizer="chars", max_positions=512))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    cluster = ray_cluster()
    try:
        out = pushes(configs(path, cluster.address), model, sizes, a.pushes)
        out.update(death(configs(path, cluster.address), model))
    finally:
        ray.shutdown()
        cluster.shutdown()
    big = max(sizes)
    result = {f"relay_egress_ratio_n{big}": out["egress_ratio"]["relay"][big],
              f"star_egress_ratio_n{big}": out["egress_ratio"]["star"][big], **out}
    sys.stderr.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
