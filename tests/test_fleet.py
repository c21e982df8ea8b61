"""A fleet past one machine: a real 3-node Ray cluster on loopback (ray.cluster_utils.Cluster, each
node with its own resources), real servers in placement groups, the real Mooncake engine, nodes
removed and servers frozen with signals while rollouts run."""
import json
import os
import signal
import time

import httpx
import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("mooncake.engine")
pytestmark = pytest.mark.slow

FAST = dict(group_size=4, batch_size=2, max_new_tokens=24, ignore_eos=True, max_staleness=2, oversample=1.5)


@pytest.fixture(scope="module")
def cluster():
    """Head (no CPU for servers) + 3 worker nodes of 1 CPU each, all on 127.0.0.1."""
    from ray.cluster_utils import Cluster
    small = dict(node_ip_address="127.0.0.1", object_store_memory=80 << 20)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False, **small})
    workers = [c.add_node(num_cpus=1, **small) for _ in range(3)]
    ray.init(address=c.address, log_to_driver=False)
    try:
        c.wait_for_nodes()
        yield c, workers
    finally:
        ray.shutdown()
        c.shutdown()


def backend_on(cluster_address, model_path, servers=2, **weight_sync):
    from rollout.config import RolloutConfig
    from trainer_bridge.backend import BackendConfig, RolloutBackend
    from trainer_bridge.config import ClusterConfig, ServerConfig, TaskConfig, WeightSyncConfig
    cfg = BackendConfig(model_path=model_path, task=TaskConfig(name="copy", num_digits=2),
                        rollout=RolloutConfig(**FAST, progress_timeout_s=3),
                        server=ServerConfig(num_servers=servers, context_length=256, device="cpu", dtype="float32"),
                        weight_sync=WeightSyncConfig(bucket_mb=1, **{"timeout_s": 5, **weight_sync}),
                        cluster=ClusterConfig(kind="ray", address=cluster_address, placement_timeout_s=10))
    return RolloutBackend(cfg)


@pytest.fixture(scope="module")
def chars_model(tmp_path_factory):
    from inference_server.tiny_model import build_tiny_model
    return str(build_tiny_model(tmp_path_factory.mktemp("chars"), hidden=64, layers=2, heads=4, kv_heads=2,
                                max_positions=512, tokenizer="chars", seed=0))


def model_of(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def node_of(backend, url):
    return backend.fleet.info(url)["node_id"]


def version(url):
    return int(httpx.get(f"{url}/get_weight_version", timeout=10).json()["weight_version"])


def digest(url):
    return httpx.get(f"{url}/weight_sync/digest", timeout=30).json()["digest"]


def gone(url, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=1)
        except httpx.ConnectError:
            return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def test_servers_get_placement_groups_of_their_own_across_nodes(cluster, chars_model):
    c, _ = cluster
    with backend_on(c.address, chars_model, servers=3) as b:
        b.start(model_of(chars_model))
        groups = {b.fleet.replicas[u][1].id for u in b.servers}
        nodes = {node_of(b, u) for u in b.servers}
        assert len(b.servers) == 3 and len(groups) == 3 and len(nodes) == 3
        batch = b.next_batch(timeout_s=120)
        assert len(batch.samples) == 8 and len({s.uid for s in batch.samples}) == 8
        with pytest.raises(RuntimeError, match=r"cannot place 1 server.*CPU.*free"):
            b.add_servers(1)                     # every CPU is taken: refused in time, with the reason


def test_a_lost_node_loses_no_sample_and_its_server_is_replaced(cluster, chars_model):
    """remove_node under a server mid-rollout: the batch completes with every sample once, the next
    push commits on the survivor, and a replacement comes up on the free node at that version."""
    c, workers = cluster
    model = model_of(chars_model)
    with backend_on(c.address, chars_model, servers=2) as b:
        b.start(model)
        victim = b.servers[0]
        node = next(w for w in workers if w.node_id == node_of(b, victim))
        seen, pushes = [], []

        def step():                              # what a trainer does: a batch, then a new version
            seen.extend(b.next_batch(timeout_s=120).samples)
            t0 = time.monotonic()
            pushes.append((b.push_weights(model, version=b.version + 1), time.monotonic() - t0))
        step()
        c.remove_node(node)                      # the server's node goes, mid-rollout (rollout never pauses)
        assert gone(victim), "the server died with its node"
        step()
        assert b.rollout.status()["metrics"]["retries"] > 0, "requests on the lost server moved"
        stats, took = pushes[-1]
        assert victim in stats.dropped and took < 5, "the push after the loss commits on the survivor in time"
        survivor = next(u for u in stats.serving if u != victim)
        assert stats.serving[survivor] == 2 and victim not in b.servers
        deadline = time.monotonic() + 120
        while b.stats.replacements < 1 and time.monotonic() < deadline:
            step()                               # joining happens between the trainer's calls
        new = next(u for u in b.servers if u != survivor)
        assert node_of(b, new) not in (node.node_id, node_of(b, survivor)) and version(new) == b.version
        served_before = httpx.get(f"{new}/get_server_info").json()["stats"]["finished_requests"]
        for _ in range(2):
            step()
        assert httpx.get(f"{new}/get_server_info").json()["stats"]["finished_requests"] > served_before
        state = b.state_dict()
        started = state["data"]["cursor"] + state["data"]["epoch"] * len(b.items)
        dropped = sum(state["metrics"]["drops"].values())
        assert len({s.uid for s in seen}) == len(seen), "no sample handed out twice"
        assert started == len({s.group_id for s in seen}) + len(state["groups"]) + dropped, "every prompt accounted for"
    c.add_node(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=80 << 20)


def test_a_frozen_server_is_evicted_not_waited_for(cluster, chars_model):
    c, _ = cluster
    model = model_of(chars_model)
    with backend_on(c.address, chars_model, servers=2) as b:
        b.start(model)
        frozen = b.servers[1]
        pid = b.fleet.pid(frozen)
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            stats = b.push_weights(model, version=1)
            took = time.monotonic() - t0
        finally:
            if os.path.exists(f"/proc/{pid}"):
                os.kill(pid, signal.SIGCONT)
        assert frozen in stats.dropped and frozen not in b.servers and took < 2 * 5
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        assert len(b.next_batch(timeout_s=120).samples) == 8


def test_a_push_after_add_servers_reaches_the_new_server(cluster, chars_model):
    c, _ = cluster
    model = model_of(chars_model)
    with backend_on(c.address, chars_model, servers=1) as b:
        b.start(model)
        b.push_weights(model, version=1)
        (new,) = b.add_servers(1)
        assert version(new) == 1 and new in b.servers          # cold-started from the live one
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        stats = b.push_weights(model, version=2)
        assert stats.serving == {b.servers[0]: 2, new: 2}
        assert digest(new) == digest(b.servers[0])
        b.remove_servers([new])
        assert b.servers == [b.servers[0]] and len(b.next_batch(timeout_s=120).samples) == 8


def test_a_short_grpo_run_with_cluster_ray(cluster, chars_model, tmp_path):
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from tests.test_trainer_bridge import FAST as JOB_FAST
    from trainer_bridge.job.run import run
    from trainer_bridge.train import to_job
    c, _ = cluster
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "configs"), version_base=None):
        cfg = compose(config_name="config", overrides=[
            "cluster=ray", f"cluster.address={c.address}", f"run_dir={tmp_path / 'run'}", f"model.path={chars_model}",
            "model.build_tiny=false", "server.num_servers=2", "trainer.steps=3", "logger.wandb=false",
            "trainer.world_size=2", "trainer.checkpoint_every=2", *JOB_FAST])
    result = run(to_job(cfg))
    assert result["steps"] == 3
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    # trainer rank 1 was a Ray actor (the third node's CPU): it wrote its own shard into the servers
    assert rows[-1]["sync/egress_bytes/rank1"] > 0 and rows[-1]["sync/egress_bytes/rank0"] > 0
    assert (tmp_path / "run" / "checkpoints" / "step-000003" / "sharded").is_dir()
    assert not ray.util.placement_group_table() or all(
        g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())
