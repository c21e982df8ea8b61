"""Start and stop server subprocesses on free loopback ports (tests, benches, launches): Riptide's
server and a stock vLLM one. What is not about a server (ports, process groups) is platforms/process.py."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import httpx

from platforms.process import ChildProcess, free_port


def cpu_share_args(num_servers: int) -> list[str]:
    """Server flags for `num_servers` processes sharing this machine's cores (ignored off CPU).

    A server alone uses all but one core for a step (engine.cpu_threads) and, on one thread, splits
    big steps over a helper thread. N servers each take cores // N: one thread fewer for the step,
    and no split when that leaves them a single core. On 2 cores, two one-thread servers beat one
    split server in both modes of bench/long_tail.py (the split's two threads hand the GIL to each
    other at every op; two processes have a GIL each)."""
    if num_servers <= 1:
        return []
    from platforms import usable_cores
    share = max(1, usable_cores() // num_servers)
    return ["--cpu-threads", str(max(1, share - 1))] + (["--no-cpu-split"] if share < 2 else [])


API_KEY_ENV = "RIPTIDE_API_KEY"        # how a server gets its bearer token: never on a command line


class ServerProcess(ChildProcess):
    """`python -m inference_server ...` as a child process; a context manager that always stops it."""

    def __init__(self, model_path: str | Path, port: int | None = None, host: str = "127.0.0.1",
                 args: list[str] | None = None, log_path: str | Path | None = None, env: dict | None = None,
                 api_key: str | None = None):
        """`api_key` reaches the server through its environment (API_KEY_ENV), never its
        command line, which any user of the machine can read."""
        super().__init__(log_path)
        self.model_path, self.host = str(model_path), host
        self.port = port or free_port(host)
        self.args = list(args or [])
        self.env = {**(env or {}), **({API_KEY_ENV: api_key} if api_key else {})}

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 120.0, cold_ok: bool = False) -> "ServerProcess":
        self.spawn()
        self.wait_ready(timeout, cold_ok)
        return self

    def spawn(self) -> "ServerProcess":
        """Start the process without waiting for it to serve (`wait_ready`): servers started
        together load their models side by side."""
        cmd = [sys.executable, "-m", "inference_server", "--model-path", self.model_path,
               "--host", self.host, "--port", str(self.port), "--parent-pid", str(os.getpid()), *self.args]
        self.popen(cmd, {**os.environ, **self.env})
        return self

    def wait_ready(self, timeout: float, cold_ok: bool = False) -> None:
        """Until /health answers 200; with `cold_ok`, also 503 for want of weights (a server that
        waits for a push: it is up, and the push comes after this returns)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server on port {self.port} exited with code {self.proc.returncode}"
                                   + (f"; see {self.log_path}" if self.log_path else ""))
            try:
                r = httpx.get(f"{self.url}/health", timeout=2)      # /health needs no token
                if r.status_code == 200 or (cold_ok and r.status_code == 503 and "no weights" in r.text):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server on port {self.port} not ready after {timeout:.0f}s")

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


VLLM_BACKEND = '{"backend": "riptide"}'


def vllm_env(python: str | Path, bind: str = "") -> dict[str, str]:
    """This process's environment for a vLLM server run by `python`, as vLLM's CPU guide sets it up:
    its OpenMP threads bound by vLLM (to `bind` when given; auto keeps one core for its scheduler),
    not by an inherited OMP_NUM_THREADS, and Intel's OpenMP preloaded when that venv has it."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")}
    if bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    return env


class VllmProcess(ServerProcess):
    """A stock vLLM OpenAI server (`vllm serve`) that speaks Riptide's server protocol on its own URL:
    the riptide weight-transfer backend and middleware (inference_server/vllm_plugin.py), vLLM's RL
    endpoints (VLLM_SERVER_DEV_MODE=1) and its token-in/token-out API (--enable-scale-out). `python`
    is an interpreter with vLLM and this package installed; `version` labels the checkpoint it loads.
    On CPU it runs as vLLM's CPU guide sets it up (Intel's OpenMP preloaded when present, threads
    bound by vLLM unless `env` says otherwise)."""

    def __init__(self, model_path: str | Path, python: str | Path | None = None, version: int = 0,
                 max_num_seqs: int = 64, max_model_len: int = 1024, dtype: str = "auto", seed: int = 0,
                 kv_space_gb: int = 1, no_weights: bool = False, **kw):
        """`no_weights`: start without reading the checkpoint's weights (vLLM's dummy load; the model
        directory needs only its config and tokenizer) and serve nothing until a push commits."""
        super().__init__(model_path, **kw)
        self.python, self.no_weights = str(python or sys.executable), no_weights
        self.flags = ["--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len),
                      "--dtype", dtype, "--seed", str(seed)] + (["--load-format", "dummy"] if no_weights else [])
        api_key = self.env.pop(API_KEY_ENV, None)
        self.env = {"VLLM_SERVER_DEV_MODE": "1", "RIPTIDE_WEIGHT_VERSION": str(version),
                    "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gb), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                    "HF_HUB_OFFLINE": "1", **({"VLLM_API_KEY": api_key} if api_key else {}),
                    **({"RIPTIDE_NO_WEIGHTS": "1"} if no_weights else {}), **self.env}

    def spawn(self) -> "VllmProcess":
        cmd = [self.python, "-m", "inference_server.vllm_serve", "--parent-pid", str(os.getpid()),
               "--model", self.model_path, "--host", self.host, "--port", str(self.port),
               "--weight-transfer-config", VLLM_BACKEND, "--middleware", "inference_server.vllm_plugin.riptide_routes",
               "--enable-scale-out", "--disable-log-stats", *self.flags, *self.args]
        self.popen(cmd, {**vllm_env(self.python), **self.env})
        return self

    def wait_ready(self, timeout: float, cold_ok: bool = False) -> None:
        """Until /health answers (503 "no weights" for a server started without them) and the
        weight-sync endpoints are up (the first call starts them)."""
        super().wait_ready(timeout, cold_ok=self.no_weights)
        headers = {"Authorization": f"Bearer {self.env['VLLM_API_KEY']}"} if "VLLM_API_KEY" in self.env else {}
        r = httpx.get(f"{self.url}/weight_sync/status", headers=headers, timeout=max(1.0, timeout))
        if r.status_code != 200:
            self.stop()
            raise RuntimeError(f"vLLM on port {self.port}: its riptide weight-sync endpoints answered "
                               f"{r.status_code}: {r.text[:300]}" + (f"; see {self.log_path}" if self.log_path else ""))
