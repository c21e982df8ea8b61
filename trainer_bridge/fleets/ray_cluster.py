"""`cluster=ray`: servers and the rollout manager as Ray actors.

Each inference server is an actor in a placement group of its own (one bundle, the resources of
`platform_bundle`), so replicas come and go one at a time. The actor runs the server as a child
process on its node, bound to the node's address (never 127.0.0.1 off one machine), and reports its
URL and its Mooncake segment; the server dies with the actor (parent-death watch) and the actor with
its node. A placement the cluster cannot satisfy fails within `placement_timeout_s`, saying what was
asked and what the cluster has. The rollout manager is one more actor, on the trainer's node (no
resources reserved: it waits on the network; and it must not go down with a server's node),
running `rollout.service.RolloutService` on the actor's event loop.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from platforms import server_bundle
from platforms.process import free_port, is_loopback
from inference_server.process import ServerProcess, VllmProcess
from rollout.service import RolloutHost, RolloutService, RolloutSpec
from trainer_bridge.config import ClusterConfig, ServerConfig, WeightSyncConfig
from trainer_bridge.fleets.local import model_files, server_args, take_from_peer

log = logging.getLogger(__name__)


def connect(cluster: ClusterConfig) -> None:
    """Join the cluster at `cluster.address`, or start a local one (on loopback when no address)."""
    global _LOCAL
    if ray.is_initialized():
        return
    _LOCAL = not cluster.address
    if cluster.address:
        ray.init(address=cluster.address, log_to_driver=False)
    else:
        # Ray reads this at start: without it, a local cluster puts its nodes (and so the servers)
        # on the machine's interface address even when asked for 127.0.0.1
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)


_LOCAL = False          # connect() started a cluster of this machine's own: everything stays on loopback


def node_address() -> str:
    """Where this node's processes listen and are reached: loopback in a local cluster (Ray may
    name the machine's interface address there), else the address the node joined with."""
    return "127.0.0.1" if _LOCAL else ray.util.get_node_ip_address()


def server_log_dir() -> Path:
    """Where a node's server logs go."""
    path = Path(tempfile.gettempdir()) / "riptide-ray-servers"
    path.mkdir(exist_ok=True)
    return path


def model_here(model_path: str, files: dict[str, bytes] | None, host: str, weights_coming: bool) -> tuple[str, bool]:
    """(a model directory on this host, whether it lacks the weights). A host that cannot read
    `model_path` (no shared filesystem) gets `files` (the checkpoint's config and tokenizer) written
    to a local directory; its server starts without weights, which must come by a push or a peer."""
    if (Path(model_path) / "config.json").is_file():
        return model_path, False
    if not files or not weights_coming:
        raise RuntimeError(f"host {host} cannot read model.path={model_path!r} and no weights would reach it: "
                           f"put the checkpoint there, or start the job with a model to push")
    local = tempfile.mkdtemp(prefix="riptide-model-")
    for name, data in files.items():
        (Path(local) / name).write_bytes(data)
    return local, True


class ServerActor:
    """One inference server on this actor's node."""

    def start(self, model_path: str, args: list[str], timeout_s: float, api_key: str | None = None,
              host: str | None = None, files: dict[str, bytes] | None = None, pushed: bool = False) -> dict:
        """Start the server. A host that cannot read `model_path` (no shared filesystem) writes
        `files` (the checkpoint's config and tokenizer) to a local directory and starts without
        weights: a live peer (--weights-from-peer) or the trainer's next push brings them."""
        host = host or ray.util.get_node_ip_address()
        model_path, cold = model_here(model_path, files, host, "--weights-from-peer" in args or pushed)
        self.local = model_path if cold else None       # written here: removed with the server
        if cold:
            if "--weights-from-peer" not in args:
                args = args + ["--no-weights"]
        port = free_port(host)
        self.server = ServerProcess(model_path, port=port, host=host, args=args + ["--weight-sync-host", host],
                                    log_path=server_log_dir() / f"server-{port}.log", api_key=api_key)
        self.server.start(timeout=timeout_s, cold_ok="--no-weights" in args)
        return {"url": self.server.url, "node_id": ray.get_runtime_context().get_node_id(), "host": host,
                "pid": self.server.proc.pid, "cold": cold}

    def start_vllm(self, model_path: str, server: ServerConfig, version: int, seed: int, host: str | None = None,
                   files: dict[str, bytes] | None = None, peer: str | None = None, pushed: bool = False) -> dict:
        """A stock vLLM server (server.engine=vllm) on this node, bound to its address, its Mooncake
        engine there too. It starts without weights when this host cannot read `model_path` (the
        checkpoint's config and tokenizer come in `files`; the trainer's push brings the weights) or
        when `peer` gives them (its push_to, once this one is up)."""
        host = host or ray.util.get_node_ip_address()
        model_path, cold = model_here(model_path, files, host, bool(peer) or pushed)
        self.local = model_path if cold else None
        port = free_port(host)
        self.server = VllmProcess(model_path, python=server.vllm_interpreter(), version=version,
                                  max_num_seqs=server.max_running_requests, max_model_len=server.context_length,
                                  dtype=server.dtype, seed=seed, no_weights=bool(peer) or cold,
                                  args=list(server.vllm_args), port=port, host=host,
                                  env={"RIPTIDE_MOONCAKE_HOST": host}, log_path=server_log_dir() / f"vllm-{port}.log",
                                  api_key=server.api_key or None)
        self.server.start(timeout=server.start_timeout_s)
        if peer:
            try:
                take_from_peer(peer, self.server.url, server.api_key or None, server.start_timeout_s)
            except BaseException:
                self.server.kill()
                raise
        return {"url": self.server.url, "node_id": ray.get_runtime_context().get_node_id(), "host": host,
                "pid": self.server.proc.pid, "cold": cold}

    def kill(self) -> None:
        """Stop the server, and remove the model directory this host wrote for it (config and tokenizer)."""
        try:
            if hasattr(self, "server"):
                self.server.kill()
        finally:
            if getattr(self, "local", None):
                shutil.rmtree(self.local, ignore_errors=True)


class RolloutActor:
    """RolloutService on this actor's event loop, which keeps running between calls."""

    def __init__(self, spec: RolloutSpec):
        self.service = RolloutService(spec)

    async def call(self, method: str, *args):
        return await getattr(self.service, method)(*args)


class RayRollout(RolloutHost):
    """The trainer's side of the rollout actor: the same blocking call() as LocalRollout."""

    def start(self, spec: RolloutSpec, timeout_s: float = 120.0) -> None:
        # on the trainer's node: it must not go down with a server's node
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        self.actor = ray.remote(num_cpus=0, max_concurrency=8)(RolloutActor).options(
            scheduling_strategy=here).remote(spec)
        self.call("ping", timeout_s=timeout_s)

    def call(self, method: str, *args, timeout_s: float | None = None):
        try:
            return ray.get(self.actor.call.remote(method, *args), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"the rollout actor did not answer {method} within {timeout_s}s") from None
        except ray.exceptions.RayTaskError as e:
            raise RuntimeError(str(e.cause) if e.cause is not None else str(e)) from None

    def close(self, timeout_s: float = 30.0) -> None:
        if not hasattr(self, "actor"):
            return
        try:
            self.call("close", timeout_s=timeout_s)
        except (RuntimeError, TimeoutError, ray.exceptions.RayError) as e:
            log.warning("rollout actor did not close cleanly: %s", e)
        ray.kill(self.actor)


def wait_placed(groups: list, what: str, fields: str, timeout_s: float) -> None:
    """Wait for placement groups; past `timeout_s`, say what was asked and what the cluster has."""
    try:
        ray.get([g.ready() for g in groups], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(
            f"cannot place {what} within {timeout_s}s: the cluster has {ray.cluster_resources()} in all, "
            f"{ray.available_resources()} free ({fields}, or add nodes)") from None


def in_bundle(cls, bundle: dict, group, index: int):
    """`cls` as an actor class holding bundle `index` of placement group `group`."""
    return ray.remote(cls).options(
        num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
        resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index))


class RayFleet:
    def __init__(self, model_path: str, server: ServerConfig, weight_sync: WeightSyncConfig, cluster: ClusterConfig,
                 seed: int = 0):
        connect(cluster)
        self.model_path, self.server, self.weight_sync, self.cluster, self.seed = \
            model_path, server, weight_sync, cluster, seed
        self.host = node_address()
        self.replicas: dict[str, tuple] = {}      # url -> (actor, placement group, info)

    def launch(self, n: int, version: int, peer: str | None = None, pushed: bool = False,
               at_least: int | None = None) -> list[str]:
        """`at_least` is not taken here: a Ray fleet starts all n servers or none."""
        bundle = server_bundle(self.server.device, self.cluster.server_cpus, self.cluster.tensor_parallel)
        groups = [placement_group([bundle], strategy="STRICT_PACK") for _ in range(n)]
        actors = []
        try:
            wait_placed(groups, f"{n} server(s) of {bundle} each", "cluster.server_cpus, server.num_servers",
                        self.cluster.placement_timeout_s)
            args = server_args(self.server, self.weight_sync, self.seed, version, peer, 1)
            actors = [in_bundle(ServerActor, bundle, g, 0).remote() for g in groups]
            loopback = "127.0.0.1" if _LOCAL else None
            files = ray.put(model_files(self.model_path))
            if self.server.engine == "vllm":
                starts = [a.start_vllm.remote(self.model_path, self.server, version, self.seed, loopback, files, peer,
                                              pushed) for a in actors]
            else:
                starts = [a.start.remote(self.model_path, args, self.server.start_timeout_s,
                                         self.server.api_key or None, loopback, files, pushed) for a in actors]
            infos = ray.get(starts, timeout=self.server.start_timeout_s + 30)
        except BaseException:
            for a in actors:
                ray.kill(a)
            for g in groups:
                remove_placement_group(g)
            raise
        for a, g, info in zip(actors, groups, infos):
            self.replicas[info["url"]] = (a, g, info)
        return [info["url"] for info in infos]

    def loopback(self) -> bool:
        return all(is_loopback(n["NodeManagerAddress"]) for n in ray.nodes() if n["Alive"])

    def stop(self, url: str) -> None:
        actor, group, _ = self.replicas.pop(url, (None, None, None))
        if actor is None:
            return
        try:
            ray.get(actor.kill.remote(), timeout=3)
        except ray.exceptions.RayError as e:     # its node is gone or cut off (it dies with the node), or the actor
            log.info("server %s already gone: %s", url, type(e).__name__)
        ray.kill(actor)
        remove_placement_group(group)

    def info(self, url: str) -> dict:
        return self.replicas[url][2]

    def pid(self, url: str) -> int:
        return self.info(url)["pid"]

    def close(self) -> None:
        for url in list(self.replicas):
            self.stop(url)


# ---- trainer ranks 1..k-1 (trainer.world_size=k under cluster=ray) ---------------------------------------
class RankActor:
    """One trainer rank other than 0: the job's trainer side, following rank 0 (trainer_bridge.training.ranks)."""

    def run(self, entry, job, rank: int, world: int, master: str, port: int, threads: int) -> None:
        """`entry(job)`: the job's function (trainer_bridge.job.run.run), sent by reference."""
        import os

        import torch
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR=master, MASTER_PORT=str(port),
                          LOCAL_RANK="0")      # Ray shows the actor only its own accelerator, as device 0
        torch.set_num_threads(threads)
        entry(job)


class RayRanks:
    """Ranks 1..k-1 as Ray actors, in one placement group (PACK: together where they fit), each
    bundle `cluster.trainer_cpus` CPUs plus an accelerator when the trainer runs on one."""

    def __init__(self, job, world: int, master: str, port: int, entry):
        """On a connected cluster (trainer_ranks joined it for rank 0's address)."""
        bundle = server_bundle(job.trainer.device, job.cluster.trainer_cpus, 1)
        self.group = placement_group([bundle] * (world - 1), strategy="PACK")
        try:
            wait_placed([self.group], f"{world - 1} trainer rank(s) of {bundle} each",
                        "cluster.trainer_cpus, trainer.world_size", job.cluster.placement_timeout_s)
        except RuntimeError:
            remove_placement_group(self.group)
            raise
        self.actors = [in_bundle(RankActor, bundle, self.group, i).remote() for i in range(world - 1)]
        self.runs = [a.run.remote(entry, job, i + 1, world, master, port, max(1, int(bundle.get("CPU", 1))))
                     for i, a in enumerate(self.actors)]

    def failure(self) -> str | None:
        """Why a rank ended already (before the group formed, any end is a failure), or None."""
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as e:
                return f"trainer rank {self.runs.index(ref) + 1} (a Ray actor) failed: {e}"
            return f"trainer rank {self.runs.index(ref) + 1} (a Ray actor) ended before the ranks met"
        return None

    def stop(self, grace_s: float) -> None:
        ray.wait(self.runs, num_returns=len(self.runs), timeout=grace_s)
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.group)
