"""A chaos soak: a GRPO job (`riptide-train`, `weight_sync.audit=true`) run to its last step under a
seeded random schedule of faults, restarted with `trainer.resume=auto` whenever a fault ends it, and
audited afterwards from what it left (riptide_testing/audit.py). bench/chaos.py is the command
line; tests/test_chaos.py runs a short one.

The faults, each aimed at one process of the job as it runs (found under the trainer's process tree):

  server_kill      a server SIGKILLed: evicted, its requests resume elsewhere, a replacement cold-starts
  server_freeze    a server SIGSTOPped, then SIGCONTed after 1 s up to 2.5x the timeouts: short freezes
                   ride through, long ones are evicted and the server wakes up late, killed or stale
  sender_kill      the trainer (the weight sender) SIGKILLed right after a push began: the job dies
                   and resumes from its last checkpoint; the servers die with it
  corrupt_bucket   a byte flipped in the middle of one bucket write (riptide_testing/faults.py, a
                   wrapper around the job's transports): refused by the receiver's digest and written again
  trainer_sigterm  the trainer SIGTERMed: it finishes the step, checkpoints, exits; resumed
  rollout_kill     the rollout manager's process SIGKILLed: the trainer fails, the job resumes

Faults overlap: a freeze may still hold when the next fault lands, and a corrupted write may wait
for the next push. A job that makes no step for `hang_s` is a hang: killed, counted, resumed.
"""
from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from riptide_testing.audit import audit
from riptide_testing.faults import CORRUPT_TAKEN, CORRUPT_WRITE, job_env
from trainer_bridge.config import latest_checkpoint

KINDS = ("server_kill", "server_freeze", "sender_kill", "corrupt_bucket", "trainer_sigterm", "rollout_kill")
RESTARTING = {"sender_kill", "trainer_sigterm", "rollout_kill"}


REPO = str(Path(__file__).resolve().parents[1])   # on the job's PYTHONPATH: its processes import faults.py
UNTIL_STOPPED = 10 ** 9        # the job's steps while the fault window is open, in a time-driven soak


@dataclass
class SoakConfig:
    run_dir: str
    steps: int | None                    # the job's; None: time-driven (the window's length, then tail_steps)
    seed: int = 0
    fault_window_s: float = 1200.0       # faults start in the first this-many seconds
    mean_gap_s: float = 30.0             # mean time between faults (exponential gaps)
    max_faults: int | None = None        # no more faults once this many landed, and (time-driven) the window
                                         # closes then (None: the window's time decides)
    tail_steps: int = 50                 # time-driven: steps run after the window closes, without faults
    kinds: tuple[str, ...] = KINDS
    servers: int = 2
    timeout_s: float = 10.0              # the job's weight_sync.timeout_s and rollout.progress_timeout_s
    checkpoint_every: int = 10
    hang_s: float = 300.0
    max_lives: int = 200
    overrides: list[str] = field(default_factory=list)
    python: str = sys.executable

    def validate(self) -> None:
        bad = [k for k in self.kinds if k not in KINDS]
        if bad:
            raise ValueError(f"unknown fault kind(s) {bad}: use {', '.join(KINDS)}")
        if (self.steps is not None and self.steps < 1) or self.mean_gap_s <= 0 or self.tail_steps < 1:
            raise ValueError(f"steps={self.steps}, tail_steps={self.tail_steps} and mean_gap_s={self.mean_gap_s} "
                             f"must be > 0")


def job_command(cfg: SoakConfig, steps: int) -> list[str]:
    return [cfg.python, "-m", "trainer_bridge.train", f"run_dir={cfg.run_dir}", f"seed={cfg.seed}",
            f"trainer.steps={steps}", "trainer.resume=auto", f"trainer.checkpoint_every={cfg.checkpoint_every}",
            f"server.num_servers={cfg.servers}", "cluster.replace_evicted=true", "weight_sync.audit=true",
            f"weight_sync.timeout_s={cfg.timeout_s}", f"rollout.progress_timeout_s={cfg.timeout_s}",
            "logger.progress=false", *cfg.overrides]


# ---- processes ----------------------------------------------------------------------------------------
def _children() -> dict[int, list[int]]:
    out = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        out[ppid].append(int(entry))
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(pid: int, *markers: str) -> dict[int, str]:
    """Processes under `pid` whose command line holds one of `markers` (not zombies): pid -> that marker."""
    tree, out, todo = _children(), {}, [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            todo.append(child)
            cmd = _cmdline(child)
            found = next((m for m in markers if m in cmd), None)
            if found is not None:
                out[child] = found
    return out


def _signal(pid: int, sig: int, marker: str) -> bool:
    """Send `sig` to `pid` only while it is still the process we mean (a reused PID is left alone)."""
    if marker not in _cmdline(pid):
        return False
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


SERVER, ROLLOUT = "-m inference_server ", "-m rollout.service"


class Soak:
    def __init__(self, cfg: SoakConfig, log=print):
        cfg.validate()
        self.cfg, self.log = cfg, log
        self.rng = random.Random(cfg.seed)
        self.run_dir = Path(cfg.run_dir)
        self.faults_dir = self.run_dir / "faults"
        self.faults_dir.mkdir(parents=True, exist_ok=True)
        self.injected: collections.Counter = collections.Counter()
        self.lives: list[dict] = []
        self.hangs = 0
        self.frozen: dict[int, threading.Timer] = {}
        self.touched: dict[int, str] = {}     # pid -> marker of every process of a job: none outlives the soak
        self.proc: subprocess.Popen | None = None
        self.deck: list[str] = []

    # ---- the run -------------------------------------------------------------------------------------
    def run(self) -> dict:
        """Lives of the job until one completes its steps; then the audit. Time-driven (steps None):
        the job runs with no end while the window is open; when it closes the trainer is SIGTERMed
        (it checkpoints) and one more life, without faults, runs from that checkpoint to tail_steps
        past it, so the job ends complete."""
        self.t0 = time.monotonic()
        self.due = self.t0 + self.rng.expovariate(1 / self.cfg.mean_gap_s)
        self.steps = self.cfg.steps or UNTIL_STOPPED
        try:
            while len(self.lives) < self.cfg.max_lives:
                if self.steps == UNTIL_STOPPED and self._window_closed():
                    ckpt = latest_checkpoint(self.run_dir)
                    self.steps = (int(ckpt.name.split("-")[-1]) if ckpt is not None else 0) + self.cfg.tail_steps
                    self.log(f"{time.monotonic() - self.t0:7.1f}s  fault window closed: the job ends at step "
                             f"{self.steps}")
                if self._life() == 0:
                    break
        finally:
            self._cleanup()
        wall = time.monotonic() - self.t0
        self._count_corruptions()
        report = audit(self.run_dir, self._group_size(), self.steps)
        return {"faults_injected": dict(sorted(self.injected.items())), "faults_total": sum(self.injected.values()),
                "fault_kinds": len(self.injected), **{k: v for k, v in report.items() if k != "problems"},
                "hangs": self.hangs, "lives": len(self.lives), "wall_s": round(wall, 1), "seed": self.cfg.seed,
                "problems": report["problems"][:20]}

    def _window_closed(self) -> bool:
        """The window's time is up, or max_faults have landed."""
        landed = self.cfg.max_faults is not None and sum(self.injected.values()) >= self.cfg.max_faults
        return landed or time.monotonic() - self.t0 >= self.cfg.fault_window_s

    def _life(self) -> int:
        """One run of the job until it exits, faults landing on it meanwhile; its exit code."""
        env = {**os.environ, **job_env(self.faults_dir), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
               "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
        log_path = self.run_dir / f"life-{len(self.lives):03d}.log"
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen(job_command(self.cfg, self.steps), stdout=out, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        started = last_progress = last_scan = time.monotonic()
        last_step, stopping = -1, False
        while self.proc.poll() is None:
            time.sleep(0.1)
            now = time.monotonic()
            self._count_corruptions()
            if now - last_scan > 2.0:            # the job's processes, to stop any it leaves behind
                self.touched.update(descendants(self.proc.pid, SERVER, ROLLOUT))
                last_scan = now
            step = self._steps_logged()
            if step != last_step:
                last_step, last_progress = step, now
            if now - last_progress > self.cfg.hang_s:
                self.hangs += 1
                self.log(f"hang: no step for {self.cfg.hang_s:.0f}s (life {len(self.lives)}); killing it")
                self._kill_job()
                break
            if self.steps == UNTIL_STOPPED and self._window_closed() and not stopping:
                self.proc.send_signal(signal.SIGTERM)      # the soak's own stop: not a fault
                stopping = True
            if now >= self.due:
                if not self._window_closed() and not self._enough():
                    self._inject()
                self.due = now + self.rng.expovariate(1 / self.cfg.mean_gap_s)
        rc = self.proc.wait()
        self._kill_job()             # what the trainer started and left (it was SIGKILLed)
        self.lives.append({"rc": rc, "seconds": round(time.monotonic() - started, 1), "log": str(log_path)})
        self.log(f"life {len(self.lives) - 1} ended: exit {rc} after {time.monotonic() - started:.0f}s")
        return rc

    def _steps_logged(self) -> int:
        try:
            return (self.run_dir / "metrics.jsonl").stat().st_size
        except OSError:
            return 0

    # ---- faults --------------------------------------------------------------------------------------
    def _inject(self) -> None:
        """The next fault of the schedule: kinds are dealt from a shuffled deck of all of them, so
        every kind comes up once in each round; one with no target now (a server still starting)
        stays first in the deck for the next time."""
        if not self.deck:
            self.deck = list(self.cfg.kinds)
            self.rng.shuffle(self.deck)
        kind = self.deck.pop(0)
        if kind == "corrupt_bucket" and (self.faults_dir / CORRUPT_WRITE).exists() and self.deck:
            self.deck.append(kind)              # one waits for a write already
            kind = self.deck.pop(0)
        done = getattr(self, f"_{kind}")()
        if not done:
            self.deck.insert(0, kind)
        elif kind != "corrupt_bucket":          # a corruption counts once a write took it
            self.injected[kind] += 1
        self.log(f"{time.monotonic() - self.t0:7.1f}s  {kind}{'' if done else ' (no target now)'}")

    def _enough(self) -> bool:
        """max_faults landed (a corruption not yet taken by a write counts: it waits for the next one)."""
        waiting = (self.faults_dir / CORRUPT_WRITE).exists()
        return self.cfg.max_faults is not None and sum(self.injected.values()) + waiting >= self.cfg.max_faults

    def _pick(self, marker: str) -> int | None:
        pids = [p for p in descendants(self.proc.pid, marker) if p not in self.frozen]
        return self.rng.choice(sorted(pids)) if pids else None

    def _server_kill(self) -> bool:
        pid = self._pick(SERVER)
        if pid is None:
            return False
        self.touched[pid] = SERVER
        return _signal(pid, signal.SIGKILL, SERVER)

    def _server_freeze(self) -> bool:
        pid = self._pick(SERVER)
        if pid is None or not _signal(pid, signal.SIGSTOP, SERVER):
            return False
        self.touched[pid] = SERVER
        seconds = self.rng.uniform(1.0, 2.5 * self.cfg.timeout_s)
        timer = threading.Timer(seconds, self._thaw, args=(pid,))
        timer.daemon = True
        self.frozen[pid] = timer
        timer.start()
        return True

    def _thaw(self, pid: int) -> None:
        self.frozen.pop(pid, None)
        _signal(pid, signal.SIGCONT, SERVER)

    def _sender_kill(self) -> bool:
        """SIGKILL the trainer as soon as a new push begins (its line in pushes.jsonl)."""
        path = self.run_dir / "logs" / "pushes.jsonl"
        size = path.stat().st_size if path.exists() else 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and self.proc.poll() is None:
            if path.exists() and path.stat().st_size > size:
                break
            time.sleep(0.001)
        else:
            return False
        self.proc.send_signal(signal.SIGKILL)
        return True

    def _corrupt_bucket(self) -> bool:
        (self.faults_dir / CORRUPT_WRITE).touch()
        return True

    def _count_corruptions(self) -> None:
        taken = self.faults_dir / CORRUPT_TAKEN
        try:
            taken.unlink()
        except FileNotFoundError:
            return
        self.injected["corrupt_bucket"] += 1

    def _trainer_sigterm(self) -> bool:
        if self.proc.poll() is not None:
            return False
        self.proc.send_signal(signal.SIGTERM)
        return True

    def _rollout_kill(self) -> bool:
        pid = self._pick(ROLLOUT)
        if pid is None:
            return False
        return _signal(pid, signal.SIGKILL, ROLLOUT)

    # ---- cleanup -------------------------------------------------------------------------------------
    def _kill_job(self) -> None:
        """The trainer's session, then every server and rollout process it had (sessions of their own),
        by PID."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.touched.update(descendants(self.proc.pid, SERVER, ROLLOUT))
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
        self._reap_touched()

    def _reap_touched(self) -> None:
        for pid, marker in list(self.touched.items()):
            _signal(pid, signal.SIGKILL, marker)        # a stopped process dies of it too

    def _cleanup(self) -> None:
        for timer in list(self.frozen.values()):
            timer.cancel()
        if self.proc is not None and self.proc.poll() is None:
            self._kill_job()
        self._reap_touched()
        self.frozen.clear()

    def _group_size(self) -> int:
        import yaml
        config = yaml.safe_load((self.run_dir / "config.yaml").read_text())
        return int(config["rollout"]["group_size"])
