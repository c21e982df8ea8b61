"""The rollout manager in a process of its own, off the trainer's GIL.

`RolloutService` is what runs there: the manager, its router and clients, the data, the tokenizer
and the reward, on one event loop that keeps running between calls. Every method is a coroutine on
that loop. Two hosts run it: `LocalRollout` (here) in a subprocess, spoken to over a pipe, and a Ray
actor (`trainer_bridge.fleets.ray_cluster.RayRollout`) under `cluster=ray`. Both give the trainer the same
blocking `call(method, *args)`; `RolloutBackend` uses nothing else. What crosses is plain data:
groups of samples, metrics dicts, state dicts.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.agent import RolloutFn, single_turn
from rollout.client import ServerClient, client_for
from rollout.config import RolloutConfig
from rollout.data import PromptSource
from rollout.filters import get_filter
from rollout.manager import RolloutManager
from rollout.rewards import get_reward
from rollout.router import Router

log = logging.getLogger(__name__)


@dataclass
class RolloutSpec:
    """All it takes to build the manager in another process (picklable: callables by reference)."""
    cfg: RolloutConfig
    urls: list[str]
    model_path: str                      # for the tokenizer
    items: list[dict]
    reward: str                          # module:function or a built-in name
    rollout_fn: RolloutFn = single_turn
    api_key: str | None = None
    seed: int = 0
    state: dict | None = None            # a manager state_dict to resume from
    trainer_version: int = 0
    log_level: int = logging.WARNING
    engine: str = "riptide"              # the servers' (server.engine): which client speaks to them


def load_tokenizer(path: str):
    """The model's tokenizer; from its tokenizer.json when it has one, which spares the rollout
    process importing torch (it starts in ~1 s instead of ~3.5 s here)."""
    if (Path(path) / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


class RolloutService:
    def __init__(self, spec: RolloutSpec):
        logging.getLogger().setLevel(spec.log_level)
        self.spec = spec
        self.tokenizer = load_tokenizer(spec.model_path)
        router = Router([self._client(u) for u in spec.urls])
        self.manager = RolloutManager(spec.cfg, router, PromptSource(spec.items, seed=spec.seed), self.tokenizer,
                                      get_reward(spec.reward), spec.rollout_fn, get_filter(spec.cfg.group_filter))
        if spec.state is not None:
            self.manager.load_state_dict(spec.state)
        else:
            self.manager.consumed_groups = 0
        self.manager.trainer_version = spec.trainer_version

    def _client(self, url: str) -> ServerClient:
        cfg = self.spec.cfg
        return client_for(self.spec.engine, url, timeout_s=cfg.request_timeout_s, api_key=self.spec.api_key,
                          max_connections=cfg.max_inflight)

    async def ping(self) -> str:
        return "ok"

    async def start(self) -> None:
        await self.manager.start()

    async def next_batch(self, as_of: int | None = None) -> tuple[list, dict]:
        return await self.manager.next_batch(as_of)

    async def batch_ready(self, as_of: int | None = None) -> bool:
        return self.manager.batch_ready(as_of)

    async def on_weights_updated(self, version: int, on_policy: bool = False) -> None:
        await self.manager.on_weights_updated(version, on_policy=on_policy)

    async def add_server(self, url: str) -> None:
        self.manager.router.add(self._client(url))

    async def remove_server(self, url: str) -> None:
        """Leave the router: its requests in flight are cancelled and resume on the others."""
        await self.manager.router.remove(url)

    async def state(self) -> dict:
        """Pause (in-flight samples become partial), read the state, go on."""
        await self.manager.stop()
        state = self.manager.state_dict()
        await self.manager.start()
        return state

    async def status(self) -> dict:
        m = self.manager
        return {"servers": [c.url for c in m.router.clients], "down": list(m.router.down),
                "inflight": len(m.inflight), "metrics": m.metrics.snapshot()}

    async def down_servers(self) -> list[str]:
        """The servers the router has marked down."""
        return list(self.manager.router.down)

    async def close(self) -> None:
        if not self.manager.stopping:
            await self.manager.stop()
        await self.manager.router.close()


class RolloutHost:
    """The rollout process's methods (RolloutService's), typed, over a host's `call`: the trainer
    side (RolloutBackend) calls these, never a method named by string. Each host (ThreadRollout,
    LocalRollout, fleets/ray_cluster.RayRollout, the backend's NoManager) supplies `call`."""

    def call(self, method: str, *args, timeout_s: float | None = None) -> Any:
        raise NotImplementedError

    def start_manager(self) -> None:
        self.call("start")

    def next_batch(self, as_of: int | None = None, timeout_s: float | None = None) -> tuple[list, dict]:
        return self.call("next_batch", as_of, timeout_s=timeout_s)

    def batch_ready(self, as_of: int | None = None) -> bool:
        return bool(self.call("batch_ready", as_of))

    def on_weights_updated(self, version: int, on_policy: bool = False) -> None:
        self.call("on_weights_updated", version, on_policy)

    def state(self) -> dict:
        return self.call("state")

    def status(self) -> dict:
        return self.call("status")

    def add_server(self, url: str) -> None:
        self.call("add_server", url)

    def remove_server(self, url: str) -> None:
        self.call("remove_server", url)

    def down_servers(self) -> list[str]:
        return list(self.call("down_servers") or [])


class ThreadRollout(RolloutHost):
    """RolloutService on an event loop in a thread of this process (`cluster.rollout_process=false`):
    no process to start, but the manager shares the trainer's GIL."""

    def __init__(self):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-loop", daemon=True)
        self._thread.start()

    def start(self, spec: RolloutSpec, timeout_s: float = 120.0) -> None:
        self.service = RolloutService(spec)

    def call(self, method: str, *args, timeout_s: float | None = None) -> Any:
        fut = asyncio.run_coroutine_threadsafe(getattr(self.service, method)(*args), self._loop)
        try:
            return fut.result(timeout_s)
        except TimeoutError:
            fut.cancel()
            raise TimeoutError(f"the rollout loop did not answer {method} within {timeout_s}s") from None

    def close(self, timeout_s: float = 30.0) -> None:
        try:
            if hasattr(self, "service"):
                self.call("close", timeout_s=timeout_s)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)


def _console():
    """Where the child's stderr goes: this process's sys.stderr (the console even when native
    libraries' stderr has been sent to a log file), or the inherited descriptor."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


class LocalRollout(RolloutHost):
    """RolloutService in a subprocess of its own (`python -m rollout.service`), spoken to over a
    socket pair. Not multiprocessing's spawn: that re-runs the trainer's main script in the child,
    which a plain script without a main guard would not survive. So callables in the spec must be
    importable by module (not defined in `__main__`); the backend falls back to a thread otherwise."""

    def __init__(self):
        """Starts the process, which imports its modules while the caller gets the servers going."""
        from multiprocessing.connection import Connection
        mine, theirs = socket.socketpair()
        with theirs:
            self._proc = subprocess.Popen([sys.executable, "-m", "rollout.service", str(theirs.fileno())],
                                          pass_fds=[theirs.fileno()], stderr=_console())
        self._conn = Connection(mine.detach())
        self._lock = threading.Lock()
        self._started = self._broken = False

    def start(self, spec: RolloutSpec, timeout_s: float = 120.0) -> None:
        """Build the service there from `spec`."""
        self._conn.send(spec)
        self._started = True
        self.call("ping", timeout_s=timeout_s)

    def call(self, method: str, *args, timeout_s: float | None = None) -> Any:
        with self._lock:
            if self._broken:
                raise RuntimeError(f"the rollout process's channel broke during an earlier call: {method} not sent")
            try:
                self._conn.send((method, args))
                if not self._conn.poll(timeout_s):
                    raise TimeoutError(f"the rollout process did not answer {method} within {timeout_s}s")
                ok, value = self._conn.recv()
            except (EOFError, BrokenPipeError, ConnectionResetError):
                self._broken = True
                raise RuntimeError(f"the rollout process died (exit code {self._died()}) during {method}: "
                                   f"its groups in flight are in the last checkpoint; resume from it "
                                   f"(trainer.resume=latest)") from None
            except BaseException:                # a timeout or Ctrl-C mid-message: answers are out of step now
                self._broken = True
                raise
        if not ok:
            raise RuntimeError(value)
        return value

    def _died(self) -> int | None:
        try:
            return self._proc.wait(5)          # the socket can close a moment before the exit is seen
        except subprocess.TimeoutExpired:
            return None

    def close(self, timeout_s: float = 30.0) -> None:
        if self._proc.poll() is None and self._started and not self._broken:
            try:
                self.call("close", timeout_s=timeout_s)
            except (RuntimeError, TimeoutError, OSError) as e:
                log.warning("rollout process did not close cleanly: %s", e)
        self._conn.close()                       # never started: it sees EOF and exits
        if self._broken and self._proc.poll() is None:
            self._proc.terminate()               # it may be inside the call we gave up on
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _serve(fd: int) -> None:
    """The rollout process: the service's loop runs forever on this thread; calls arrive on another.
    Ctrl-C is the trainer's to handle: it closes this process; a trainer that dies ends it too (its
    end of the socket closes)."""
    from multiprocessing.connection import Connection
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    import transformers  # noqa: F401  (the slow import, done while the trainer starts its servers)
    try:
        spec = conn.recv()
    except EOFError:                             # the trainer went away before it needed us
        return
    loop = asyncio.new_event_loop()
    try:
        service = RolloutService(spec)
    except Exception as e:
        conn.recv()
        conn.send((False, f"the rollout process failed to start: {type(e).__name__}: {e}"))
        return

    def reader() -> None:
        while True:
            try:
                method, args = conn.recv()
            except (EOFError, OSError):          # the trainer is gone
                loop.call_soon_threadsafe(loop.stop)
                return
            fut = asyncio.run_coroutine_threadsafe(getattr(service, method)(*args), loop)
            try:
                reply = (True, fut.result())
            except Exception as e:
                reply = (False, f"{type(e).__name__}: {e}" if not isinstance(e, RuntimeError) else str(e))
            try:
                conn.send(reply)
            except OSError:                      # the trainer stopped listening
                method = "close"
            except Exception as e:               # an answer that does not pickle
                conn.send((False, f"the answer to {method} could not be sent: {type(e).__name__}: {e}"))
            if method == "close":
                loop.call_soon_threadsafe(loop.stop)
                return
    threading.Thread(target=reader, name="rollout-calls", daemon=True).start()
    loop.run_forever()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
    # Closed (the trainer waits on this exit): leave without the interpreter's teardown of torch and
    # transformers, a few tenths of a second of nothing at the end of every job.
    logging.shutdown()
    sys.stderr.flush()
    os._exit(0)

