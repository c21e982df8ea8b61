"""Helpers shared by the benchmarks: a tiny model on disk, and Riptide's server as a subprocess."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def tiny_model_dir(hidden: int = 384, layers: int = 4, vocab: int = 8000, root: str | None = None) -> Path:
    """Build (once) the tiny random Qwen2 checkpoint into a temp dir and return its path."""
    base = Path(root or tempfile.gettempdir()) / f"riptide_bench_tiny_h{hidden}_l{layers}_v{vocab}"
    if not (base / "config.json").exists() or not any(base.glob("*.safetensors")):
        from inference_server.tiny_model import build_tiny_model
        build_tiny_model(base, hidden=hidden, layers=layers, vocab=vocab)
    return base


@contextlib.contextmanager
def riptide_server(model_path: str | Path, *extra_args: str, startup_timeout: float = 180.0,
                   env: dict | None = None, log_path: str | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start `python -m inference_server` on a free port; yield (base_url, process); always stop it."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "inference_server", "--model-path", str(model_path),
           "--host", HOST, "--port", str(port), *extra_args]
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="riptide_server_", suffix=".log")
        os.close(fd)
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})
    url = f"http://{HOST}:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                tail = Path(log_path).read_text(errors="replace")[-4000:]
                raise RuntimeError(f"server exited with {proc.returncode} during startup:\n{tail}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy within {startup_timeout:.0f} s (log: {log_path})")
            time.sleep(0.25)
        yield url, proc
    finally:
        stop_process(proc)
        log.close()


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process (its own session), then SIGKILL it if it does not exit in `grace` seconds."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
