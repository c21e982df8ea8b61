"""Process and host utilities with nothing of a server in them: loopback hosts, free ports, a process
that dies with its parent, and a child process in a session of its own, stopped with its group.
inference_server/process.py builds the server launchers on them."""
from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct free ports: every socket held until all are chosen (bound and closed one at a time,
    the kernel can hand out the same port twice: a CI run gave the Store master its RPC port as its
    metrics port, and its admin server's bind on it shut the master down)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def watch_parent(pid: int) -> None:
    """Die at once when the process that launched this one is gone (its node lost, or killed):
    a process nobody manages must not go on (a server must not serve, not even the
    requests it holds; a trainer rank must not hold its peers' collectives)."""
    def run():
        while True:
            time.sleep(0.5)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os.kill(os.getpid(), signal.SIGKILL)
                return
    threading.Thread(target=run, name="parent-watch", daemon=True).start()


class ChildProcess:
    """A command run in a session of its own (its process group: what it starts goes with it), its
    output appended to `log_path` (none: discarded). Subclasses say what to run (`spawn`)."""

    def __init__(self, log_path: str | Path | None = None):
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._log = None

    def popen(self, cmd: list[str], env: dict[str, str]) -> None:
        self._log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM to its group (and SIGCONT: a frozen process must wake to see it), SIGKILL after
        `timeout` s."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            os.killpg(self.proc.pid, signal.SIGCONT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
            self._log = None

    def kill(self) -> None:
        """SIGKILL to its group at once, frozen or not."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.stop()
