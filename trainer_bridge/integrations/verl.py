"""Riptide as a verl plugin: `rollout.name=riptide` and `rollout.checkpoint_engine.backend=riptide`.

verl loads this module through the `verl.plugins` entry point this package declares (or
`VERL_USE_EXTERNAL_MODULES=trainer_bridge.integrations.verl`), which registers:

- `RiptideReplica` in `RolloutReplicaRegistry` as "riptide": a replica is one Riptide server, run by a
  `RiptideServer` actor (verl's server handle): token ids in, `TokenOutput` (ids, per-token logprobs,
  stop reason, the weight versions in `extra_fields`) out, with verl's abort / resume / sleep / wake
  calls. `RiptideServerAdapter` is the rollout class verl's checkpoint-engine worker holds beside it.
- `RiptideCheckpointEngine` in `CheckpointEngineRegistry` as "riptide": verl's calling sequence
  (`prepare` on every actor and rollout worker, `build_topology`, `init_process_group`,
  `send_weights` on the actor with `receive_weights` on the rollout workers, `finalize`) carried by
  Riptide's weight sync: the actor's master rank streams the weights over Mooncake into every server's
  staging slots, each bucket verified against its digest, then a two-phase commit flips every server
  to version `global_steps` or none. The rollout workers receive nothing themselves: their
  `receive_weights` returns once their server serves the version (the weights went into the server,
  not through the worker), so verl's server adapter has nothing to load.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncGenerator, Generator

import httpx
import torch

try:
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.base import BaseRollout
    from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput
except ImportError as e:                         # the extra is not installed
    raise ImportError(f"trainer_bridge.integrations.verl needs verl: make setup-verl ({e})") from e

from trainer_bridge.backend import served_version

log = logging.getLogger(__name__)

# The Riptide server this process fronts, and its replica's rank: set by the server adapter, read by
# the checkpoint engine in the same verl worker process.
LOCAL_SERVERS: list[str] = []
LOCAL_REPLICA: list[int] = []


def server_actor_name(replica_rank: int) -> str:
    return f"riptide_server_{replica_rank}"


def local_server() -> str | None:
    """This worker's Riptide server: registered by its adapter, else its replica's named server actor."""
    if not LOCAL_SERVERS and LOCAL_REPLICA:
        import ray
        try:
            actor = ray.get_actor(server_actor_name(LOCAL_REPLICA[0]))
        except ValueError:
            return None
        LOCAL_SERVERS.append(ray.get(actor.get_server_address.remote()))
    return LOCAL_SERVERS[0] if LOCAL_SERVERS else None


def lora_layout_problem(names) -> str | None:
    """What is wrong with sending these weights as a whole version: verl's layout of an unmerged LoRA
    model (its base under peft's `.base_layer.` names, or peft's adapter tensors) is not the model
    the policy computes with. verl 0.9.1's checkpoint-engine path sends a LoRA model with
    `model.lora.merge=False` as its base alone, every step: served, it would sample from the base,
    never the trained adapter."""
    base = [n for n in names if ".base_layer." in n]
    adapter = [n for n in names if ".lora_A." in n or ".lora_B." in n or n.endswith((".lora_A", ".lora_B"))]
    if not base and not adapter:
        return None
    return (f"riptide checkpoint engine: verl sent an unmerged LoRA model ({len(base)} base tensors named "
            f"'...base_layer...', e.g. {(base or adapter)[0]!r}; {len(adapter)} adapter tensors), which would serve "
            f"without its adapter; set actor_rollout_ref.model.lora.merge=True, so that verl sends the merged "
            f"weights (pushed whole, by the base model's names)")


@CheckpointEngineRegistry.register("riptide")
class RiptideCheckpointEngine(CheckpointEngine):
    """verl's checkpoint engine over Riptide's weight sync (see the module's docstring). Engine
    kwargs (`rollout.checkpoint_engine.engine_kwargs.riptide`): `num_slots`, `timeout_s`,
    `protocol` (tcp | rdma), `topology` (star | chain | tree), `fan_out`, `server_url` (a rollout
    worker's server, when no adapter in its process registered one), `api_key`, `delta` (send each
    step's changed weights only, to servers that serve the last step exactly)."""

    def __init__(self, bucket_size: int, is_master: bool = False, server_url: str | None = None,
                 num_slots: int = 4, timeout_s: float = 60.0, protocol: str = "tcp", topology: str = "star",
                 fan_out: int = 2, api_key: str | None = None, device_name: str = "",
                 receive_timeout_s: float = 300.0, delta: bool = False) -> None:
        self.bucket_size, self.is_master = bucket_size, is_master
        self.server_url, self.api_key = server_url, api_key
        self.options = dict(num_slots=num_slots, timeout_s=timeout_s, protocol=protocol, topology=topology,
                            fan_out=fan_out, device_name=device_name, delta=delta)
        self.receive_timeout_s = receive_timeout_s
        self.rank, self.urls = -1, []
        self.sync = None                             # the master's WeightSync, kept across steps

    def prepare(self) -> dict[str, Any]:
        """An actor rank has no server (its metadata is None); a rollout worker names its own."""
        return {"server_url": None if self.is_master else self.server_url or local_server()}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list], dict[str, list]]:
        urls = [m["server_url"] for m in metadata[actor_wg_world_size:] if m.get("server_url")]
        urls = list(dict.fromkeys(urls))             # a server fronted by several workers is one receiver
        if not urls:
            raise ValueError("riptide checkpoint engine: no rollout worker knows its Riptide server "
                             "(rollout.name must be riptide, or give engine_kwargs.riptide.server_url)")
        actor = {"rank": list(range(actor_wg_world_size)), "urls": [urls] * actor_wg_world_size}
        rollout = {"rank": [-1] * rollout_world_size, "urls": [urls] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, urls: list[str]) -> None:
        from weight_sync.sender import WeightSync
        self.rank, self.urls = rank, list(urls)
        if not self.is_master:
            return
        if self.sync is not None:                    # the fleet of this step: servers join and leave
            have = {c.name for c in self.sync.clients}
            want = {u.rstrip("/") for u in self.urls}
            for url in want - have:
                self.sync.add_receiver(url)
            for url in have - want:
                self.sync.remove_receiver(url)
        else:
            o = self.options
            self.sync = WeightSync(self.urls, bucket_bytes=self.bucket_size, num_slots=o["num_slots"],
                                   timeout_s=o["timeout_s"], api_key=self.api_key, topology=o["topology"],
                                   fan_out=o["fan_out"], protocol=o["protocol"], device_name=o["device_name"],
                                   delta=o["delta"])

    def finalize(self) -> None:
        pass                                          # the engine and its registered slots stay for the next step

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: int | None = None) -> dict:
        if not self.is_master:
            for _ in weights:                         # other ranks take part in their gathers only
                pass
            return {}
        if global_steps is None:
            raise ValueError("riptide checkpoint engine: send_weights needs global_steps (the version it pushes)")
        tensors = {name: t.detach() for name, t in weights}
        lora = lora_layout_problem(tensors)
        if lora:
            raise ValueError(lora)
        t0 = time.perf_counter()
        stats = await asyncio.to_thread(self.sync.push, tensors, int(global_steps))
        return {"riptide/push_s": time.perf_counter() - t0, "riptide/push_bytes": float(stats.bytes),
                "riptide/servers": float(len(self.urls) - len(stats.dropped))}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Nothing passes through this worker: it returns once its server serves `global_steps`."""
        url = self.server_url or local_server()
        if url is not None and global_steps is not None:
            deadline = time.monotonic() + self.receive_timeout_s
            while (served := served_version(url, self.api_key)) is None or served < int(global_steps):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} did not reach version {global_steps} within {self.receive_timeout_s}s")
                await asyncio.sleep(0.05)
        return
        yield                                         # an async generator that yields nothing

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
            self.sync = None


class RiptideServer:
    """verl's server handle for one Riptide server (run as a Ray actor by RiptideReplica, or used
    as it is): starts the server for `model_path` and answers verl's token-in-token-out contract."""

    def __init__(self, model_path: str, response_length: int = 512, args: list[str] | None = None,
                 api_key: str | None = None, log_path: str | None = None):
        from inference_server.process import ServerProcess
        self.response_length, self.api_key = response_length, api_key
        self.process = ServerProcess(model_path, args=args, api_key=api_key, log_path=log_path).start()
        self.url = self.process.url
        self._client = None

    def get_server_address(self) -> str:
        return self.url

    def _http(self):
        from rollout.client import ServerClient
        if self._client is None:
            self._client = ServerClient(self.url, api_key=self.api_key)
        return self._client

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data=None, video_data=None, audio_data=None, mm_processor_kwargs=None,
                       priority: int = 0, **kwargs) -> TokenOutput:
        if image_data or video_data or audio_data:
            raise ValueError("riptide rollout: multimodal inputs are not supported (text only)")
        params = dict(sampling_params)
        max_new = params.pop("max_tokens", params.pop("max_new_tokens", self.response_length))
        params.pop("logprobs", None)                  # Riptide returns every token's logprob
        if params.pop("repetition_penalty", 1.0) not in (None, 1.0):
            raise ValueError("riptide rollout: repetition_penalty other than 1.0 is not supported")
        params = {k: v for k, v in params.items() if k in ("temperature", "top_p", "top_k", "min_p", "stop",
                                                           "stop_token_ids", "ignore_eos", "seed")}
        if params.get("top_k") in (None, 0):
            params["top_k"] = -1
        params["max_new_tokens"] = int(max_new)
        gen = await self._http().generate(list(map(int, prompt_ids)), params, request_id)
        stop = "aborted" if gen.finish.value == "abort" else "completed"
        return TokenOutput(token_ids=gen.output_ids, log_probs=gen.logprobs, stop_reason=stop,
                           extra_fields={"weight_versions": gen.versions,
                                         "min_global_steps": min(gen.versions, default=None),
                                         "max_global_steps": max(gen.versions, default=None)})

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            await c.post(f"{self.url}/abort_request", json={"abort_all": True}, headers=self._auth())

    async def resume_generation(self) -> None:
        pass                                          # an abort does not pause a Riptide server

    async def wake_up(self) -> None:
        pass                                          # a standalone server keeps its weights and cache

    async def sleep(self) -> None:
        pass

    async def clear_kv_cache(self) -> None:
        pass                                          # no prefix cache: the slots hold live sequences only

    async def release_kv_cache(self) -> None:
        pass                                          # a push stages into shadow weights while serving

    async def resume_kv_cache(self) -> None:
        pass

    async def start_profile(self, **kwargs) -> None:
        pass

    async def stop_profile(self) -> None:
        pass

    def _auth(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def close(self) -> None:
        """Close the HTTP session (on the loop that made it)."""
        if self._client is not None:
            await self._client.close()
            self._client = None

    def shutdown(self) -> None:
        self.process.stop()


class RiptideServerAdapter(BaseRollout):
    """The rollout class verl's checkpoint-engine worker holds: it registers its replica's server
    for the engine in this process, and has nothing to load (the weights reach the server over
    Mooncake)."""

    def __init__(self, config, model_config, device_mesh=None, *args, server_url: str | None = None, **kwargs):
        super().__init__(config, model_config, device_mesh)
        self.replica_rank = kwargs.get("replica_rank", 0)
        self.is_leader_rank = True
        LOCAL_REPLICA[:] = [self.replica_rank]
        if server_url:
            LOCAL_SERVERS[:] = [server_url]

    async def resume(self, tags: list[str]):
        pass

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs):
        from verl.workers.rollout.utils import ensure_async_iterator
        async for _ in ensure_async_iterator(weights):
            raise RuntimeError("riptide rollout: weights reach the server over Riptide's weight sync, "
                               "not through the worker; use rollout.checkpoint_engine.backend=riptide")

    async def release(self):
        pass


rollout_base._ROLLOUT_REGISTRY[("riptide", "async")] = f"{__name__}.RiptideServerAdapter"


class RiptideReplica(RolloutReplica):
    """One Riptide server per replica, run by a RiptideServer Ray actor (no GPU asked: the server
    picks its device from the node). Standalone mode: the trainer pushes into it through the
    riptide checkpoint engine."""

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self):
        import ray
        actor = ray.remote(num_cpus=0)(RiptideServer).options(
            max_concurrency=self.max_concurrency, name=server_actor_name(self.replica_rank))
        server = actor.remote(self.model_config.local_path, response_length=self.config.response_length)
        self._server_address = await server.get_server_address.remote()
        self._server_handle = server
        self.servers = [server]


RolloutReplicaRegistry.register("riptide", lambda: RiptideReplica)
