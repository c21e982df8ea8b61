"""Where inference servers run and where the rollout manager runs: `local.py` (subprocesses, the
default) and `ray_cluster.py` (Ray actors in placement groups, `cluster=ray`). The backend asks for
both through the factories here, so it never names a cluster kind itself."""
from __future__ import annotations

from rollout.service import LocalRollout, ThreadRollout
from trainer_bridge.config import ClusterConfig, ServerConfig, WeightSyncConfig
from trainer_bridge.fleets.local import Fleet, LocalFleet


def make_fleet(model_path: str, server: ServerConfig, weight_sync: WeightSyncConfig, cluster: ClusterConfig,
               seed: int = 0, log_dir: str = "") -> Fleet:
    """The servers' fleet for `cluster.kind`."""
    if cluster.kind == "ray":
        from trainer_bridge.fleets.ray_cluster import RayFleet    # Ray loads only for jobs that use it
        return RayFleet(model_path, server, weight_sync, cluster, seed)
    return LocalFleet(model_path, server, weight_sync, seed, log_dir)


def rollout_host(cluster: ClusterConfig, in_thread: bool = False):
    """Where the rollout manager runs: a process of its own (a Ray actor under cluster=ray, else a
    subprocess), or a thread of this process when `in_thread` or `cluster.rollout_process` is off."""
    if in_thread or not cluster.rollout_process:
        return ThreadRollout()
    if cluster.kind == "ray":
        from trainer_bridge.fleets.ray_cluster import RayRollout
        return RayRollout()
    return LocalRollout()
