"""Helpers shared by the benchmarks: a tiny model on disk, and Riptide's server as a subprocess."""
from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

from inference_server.process import ServerProcess


def tiny_model_dir(hidden: int = 384, layers: int = 4, vocab: int = 8000, root: str | None = None,
                   arch: str = "qwen2") -> Path:
    """Build (once) the tiny random checkpoint (Qwen2 or Llama) into a temp dir and return its path."""
    name = f"riptide_bench_tiny_h{hidden}_l{layers}_v{vocab}" + ("" if arch == "qwen2" else f"_{arch}")
    base = Path(root or tempfile.gettempdir()) / name
    if not (base / "config.json").exists() or not any(base.glob("*.safetensors")):
        from inference_server.tiny_model import build_tiny_model
        build_tiny_model(base, hidden=hidden, layers=layers, heads=hidden // 64, vocab=vocab, arch=arch)
    return base


@contextlib.contextmanager
def riptide_server(model_path: str | Path, *extra_args: str, startup_timeout: float = 180.0,
                   env: dict | None = None, log_path: str | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """`python -m inference_server` on a free port (ServerProcess); yield (base_url, process); always stop it."""
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="riptide_server_", suffix=".log")
        os.close(fd)
    server = ServerProcess(model_path, args=list(extra_args), log_path=log_path, env=env)
    try:
        server.start(timeout=startup_timeout)
        yield server.url, server.proc
    finally:
        server.stop()
