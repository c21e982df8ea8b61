"""Where inference servers run: local subprocesses (`cluster=local`) or Ray actors (`cluster=ray`,
ray_fleet.py). A fleet starts servers (from the checkpoint, or cold from a live peer's weights),
stops them for good, and says the address the trainer's weight sender should bind. Membership (who
gets rollout requests and weight pushes) is the backend's: the fleet only places processes.
"""
from __future__ import annotations

import itertools
import logging
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import httpx

from inference_server.process import ServerProcess, VllmProcess, cpu_share_args
from trainer_bridge.config import ServerConfig, WeightSyncConfig

log = logging.getLogger(__name__)


class Fleet(Protocol):
    host: str                    # the trainer's routable address (its weight sender binds it)

    def launch(self, n: int, version: int, peer: str | None = None, pushed: bool = False,
               at_least: int | None = None) -> list[str]:
        """Start n servers and return their URLs once they serve: with `peer`, each pulls that live
        server's weights (cold start), else loads the checkpoint as `version`. `pushed`: the caller
        pushes weights next, so a server on a host without the checkpoint may start without them.
        `at_least`: a fleet that can may come up with fewer (default: all n, or none)."""

    def loopback(self) -> bool:
        """Every server it starts listens on loopback (no token needed there)."""

    def stop(self, url: str) -> None:
        """Stop a server for good (killed, not asked): it never serves again."""

    def close(self) -> None: ...


def server_args(server: ServerConfig, weight_sync: WeightSyncConfig, seed: int, version: int,
                peer: str | None, share: int, log_dir: str | Path | None = None) -> list[str]:
    """`log_dir`: where the servers keep their commit records under weight_sync.audit."""
    args = ["--max-running-requests", str(server.max_running_requests), "--context-length",
            str(server.context_length), "--device", server.device, "--dtype", server.dtype, "--seed", str(seed),
            "--weight-version", str(version), "--weight-sync-protocol", weight_sync.protocol,
            "--kv-layout", server.kv_layout]
    if server.kv_cache_gb:
        args += ["--kv-cache-gb", str(server.kv_cache_gb)]
    if weight_sync.device_name:
        args += ["--weight-sync-device", weight_sync.device_name]
    if peer:
        args += ["--weights-from-peer", peer]
    if weight_sync.audit and log_dir is not None:
        args += ["--commit-log", str(log_dir)]
    if weight_sync.adapter_merge:
        args += ["--adapter-merge"]
    if server.speculative != "off":
        args += ["--speculative", str(server.speculative), "--speculative-tokens", str(server.speculative_tokens)]
    if server.kv_host_gb:
        args += ["--kv-host-gb", str(server.kv_host_gb)]
    if server.kv_keep_versions:
        args += ["--kv-keep-versions", str(server.kv_keep_versions)]
    return args + cpu_share_args(share)


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


def model_files(path: str) -> dict[str, bytes]:
    """A checkpoint's files but its weights (config, tokenizer, chat template): what a server on a
    host without the checkpoint needs, sent along with its start; the weights come by a push."""
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir())
            if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES)}


def take_from_peer(peer: str, url: str, api_key: str | None, timeout_s: float) -> None:
    """A server started without weights takes a live peer's (the peer's push_to: no trainer, no disk);
    raises, naming both, when the peer's push did not commit there."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.post(f"{peer.rstrip('/')}/weight_sync/push_to", json={"receiver_url": url}, headers=headers,
                   timeout=timeout_s)
    if r.status_code != 200:
        raise RuntimeError(f"cold start of {url} from {peer} failed ({r.status_code}): {r.text[:300]}")


def vllm_cpu_env(server: ServerConfig, i: int) -> dict[str, str]:
    """vLLM's CPU build binds its threads to every core but one; servers sharing this machine
    each get their own cores instead (VLLM_CPU_OMP_THREADS_BIND), none when only one runs."""
    if server.device not in ("auto", "cpu") or server.num_servers <= 1:
        return {}
    from platforms import platform_of, usable_cores
    if server.device == "auto" and platform_of("auto").device_type != "cpu":
        return {}
    cores = usable_cores()
    share = max(1, cores // server.num_servers)
    first = (i * share) % cores
    return {"VLLM_CPU_OMP_THREADS_BIND": f"{first}-{first + share - 1}" if share > 1 else str(first)}


def device_env(device: str, i: int) -> dict[str, str]:
    """Server i's share of this machine's accelerators: one each, round-robin, through the
    platform's visible-devices variable (none on the CPU, or when `device` names one)."""
    if device == "cpu" or ":" in device:
        return {}
    from platforms import platform_of
    platform = platform_of(device)
    count = platform.device_count()
    return platform.visible_devices([i % count]) if count > 1 else {}


class LocalFleet:
    """Servers as subprocesses of this process, on loopback; each dies with it (parent-death watch)."""

    host = "127.0.0.1"

    def __init__(self, model_path: str, server: ServerConfig, weight_sync: WeightSyncConfig, seed: int = 0,
                 log_dir: str = ""):
        self.model_path, self.server, self.weight_sync, self.seed = model_path, server, weight_sync, seed
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="riptide-servers-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, ServerProcess] = {}
        self._started = itertools.count()
        self.store_master = None               # server.kv_store=mooncake: the store's master, started with the first server

    def launch(self, n: int, version: int, peer: str | None = None, pushed: bool = False,
               at_least: int | None = None) -> list[str]:
        """Start n servers; their URLs. `at_least`: fewer may come up (one that dies while it starts is
        left out, named in the log); fewer than that, and none is kept (the error says why)."""
        if self.server.engine == "vllm":
            return self._launch_vllm(n, version, peer, at_least)
        args = server_args(self.server, self.weight_sync, self.seed, version, peer, self.server.num_servers,
                           self.log_dir)
        if self.server.kv_store == "mooncake":
            if self.store_master is None:
                from inference_server.kv_tier import StoreMaster
                self.store_master = StoreMaster(log_path=str(self.log_dir / "mooncake-master.log")).start()
            args += ["--kv-store-master", self.store_master.address, "--kv-store-metadata", self.store_master.metadata]
        procs = []
        for _ in range(n):
            i = next(self._started)
            procs.append(ServerProcess(self.model_path, args=args, log_path=self.log_dir / f"server-{i}.log",
                                       env=device_env(self.server.device, i), api_key=self.server.api_key or None))
        return self._start(procs, at_least)

    def _launch_vllm(self, n: int, version: int, peer: str | None, at_least: int | None = None) -> list[str]:
        """Stock vLLM servers (inference_server.process.VllmProcess) from the checkpoint, labelled
        `version`; with `peer`, each starts without weights (no disk read) and takes that live
        server's (its push_to), as a cold start does, serving the peer's version."""
        s = self.server
        procs = []
        for _ in range(n):
            i = next(self._started)
            procs.append(VllmProcess(self.model_path, python=s.vllm_interpreter(), version=version,
                                     max_num_seqs=s.max_running_requests, max_model_len=s.context_length,
                                     dtype=s.dtype, seed=self.seed, args=list(s.vllm_args), no_weights=bool(peer),
                                     log_path=self.log_dir / f"vllm-{i}.log",
                                     env={**device_env(s.device, i), **vllm_cpu_env(s, i)},
                                     api_key=s.api_key or None))
        urls = self._start(procs, at_least)
        procs = [p for p in procs if p.url in urls]
        if peer:
            try:
                for url in urls:
                    take_from_peer(peer, url, s.api_key or None, s.start_timeout_s)
            except BaseException:
                _stop_all(procs)
                raise
        return urls

    def _start(self, procs: list[ServerProcess], at_least: int | None = None) -> list[str]:
        up, failed = [], []
        try:
            for p in procs:
                p.spawn()
            for p in procs:
                try:
                    p.wait_ready(self.server.start_timeout_s)
                    up.append(p)
                except (RuntimeError, TimeoutError) as e:
                    failed.append((p, e))
            if failed and len(up) < (len(procs) if at_least is None else at_least):
                raise failed[0][1]
        except BaseException:
            _stop_all(procs)
            raise
        for p, e in failed:
            log.warning("a server did not start and is left out: %s", e)
            p.stop()
        self.procs.update({p.url: p for p in up})
        return [p.url for p in up]

    def loopback(self) -> bool:
        return True

    def stop(self, url: str) -> None:
        proc = self.procs.pop(url, None)
        if proc is not None:
            proc.kill()

    def pid(self, url: str) -> int:
        return self.procs[url].proc.pid

    def close(self) -> None:
        try:
            _stop_all(list(self.procs.values()))
            self.procs.clear()
        finally:
            if self.store_master is not None:
                self.store_master.stop()


def _stop_all(procs: list[ServerProcess]) -> None:
    """Stop them side by side: each takes up to its drain time."""
    if len(procs) <= 1:
        for p in procs:
            p.stop()
        return
    with ThreadPoolExecutor(len(procs)) as pool:
        list(pool.map(lambda p: p.stop(), procs))
