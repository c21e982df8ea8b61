"""The real-model recipe, measured: SmolLM2-135M-Instruct (make setup-real) trained with GRPO on a math
task it can partly do, as `riptide-train +experiment=smollm2_math` runs it, once per seed.

Each run is a `riptide-train` subprocess; every process of it (trainer, servers, rollout) is watched
through /proc for its peak resident memory (VmHWM). Held-out accuracy comes from the job's own
validation (greedy, before the first step and after the last). Ends with one JSON line:

    peak_rss_server_gb, peak_rss_trainer_gb, peak_rss_rollout_gb, peak_rss_sum_gb (the worst seed's),
    step_s_median, gen_tok_s, train_tok_s (medians over the steps of every run; step_s_median_per_run),
    train_s_median, wait_s_median, sync_s_median (a step's parts: the trainer's update, its wait for the
    batch, the push; medians over the steps), engine_tok_s (per run: tokens the servers generated over
    the seconds they spent in engine steps, read from their /metrics every 2 s: the engine's own rate
    inside the job, whatever paces the job), server_busy_fraction (those seconds over the job's time
    from the servers' first step to their last scrape), server_tokens_per_step (tokens generated over
    engine steps: the rows a step decodes, on average), server_prompt_tokens, server_gen_tokens,
    heldout_acc_before, heldout_acc_after (per seed lists, and the deltas),
    logprob_abs_diff_mean (rollout_corr/, the median step), killed (any process killed), minutes

    python bench/real_model.py                       # two seeds at the recipe's settings
    python bench/real_model.py --seeds 0 --steps 5   # a short look
    python bench/real_model.py --experiment '' --seeds 0 --steps 5 --override model=smollm2 task=gsm8k task.path=F
                                                     # the gsm8k recipe (docs/configuration.md) at its defaults: its memory
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROLES = (("inference_server", "server"), ("rollout.service", "rollout"))


def vm_hwm_gb(pid: int) -> float | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def role(pid: int, root: int) -> str:
    if pid == root:
        return "trainer"
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
    except OSError:
        return "other"
    return next((name for marker, name in ROLES if marker in cmd), "other")


class PeakWatch:
    """The peak RSS of every process under `root`, by role, polled every `period` seconds."""

    def __init__(self, root: int, period: float = 0.5):
        self.root, self.period, self.peaks = root, period, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for pid in descendants(self.root):
                gb = vm_hwm_gb(pid)
                if gb is not None:
                    key = (role(pid, self.root), pid)
                    self.peaks[key] = max(self.peaks.get(key, 0.0), gb)
            self._stop.wait(self.period)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        by_role: dict[str, float] = {}
        for (name, _), gb in self.peaks.items():
            by_role[name] = max(by_role.get(name, 0.0), gb)
        by_role["sum"] = sum(self.peaks.values())
        return by_role


def server_port(pid: int) -> int | None:
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return None
    return next((int(b) for a, b in zip(argv, argv[1:]) if a == b"--port" and b.isdigit()), None)


COUNTERS = {"riptide_generation_tokens_total": "gen_tokens", "riptide_prompt_tokens_total": "prompt_tokens",
            "riptide_engine_busy_seconds_total": "busy_s", "riptide_engine_steps_total": "steps",
            "riptide_num_running_reqs": "running", "riptide_cpu_team_steps_total": "team_steps",
            "riptide_cpu_team_stalls_total": "team_stalls"}


class ServerWatch:
    """Each server's engine counters (tokens generated, seconds in engine steps), scraped from its
    /metrics every `period` seconds; the last scrape of each server counts (they stop with the job)."""

    def __init__(self, root: int, period: float = 2.0):
        self.root, self.period, self.last, self.first_busy = root, period, {}, {}
        self.series: list[dict] = []            # every scrape: the job's timeline as the servers saw it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _scrape(self, port: int) -> dict:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in COUNTERS:
                out[COUNTERS[name]] = float(value)
        return out

    def _loop(self) -> None:
        while not self._stop.is_set():
            for pid in descendants(self.root):
                if role(pid, self.root) == "server" and (port := server_port(pid)) is not None:
                    try:
                        counters = self._scrape(port)
                    except OSError:
                        continue
                    now = time.monotonic()
                    if counters.get("steps", 0) > 0:     # when its steps began, at the latest
                        self.first_busy.setdefault(pid, now - counters.get("busy_s", 0.0))
                    self.last[pid] = (now, counters)
                    self.series.append({"t": round(now, 2), "pid": pid, **counters})
            self._stop.wait(self.period)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        gen = sum(c.get("gen_tokens", 0.0) for _, c in self.last.values())
        busy = sum(c.get("busy_s", 0.0) for _, c in self.last.values())
        span = sum(t - self.first_busy[pid] for pid, (t, _) in self.last.items() if pid in self.first_busy)
        steps = sum(c.get("steps", 0.0) for _, c in self.last.values())
        prompt = sum(c.get("prompt_tokens", 0.0) for _, c in self.last.values())
        return {"gen_tokens": gen, "prompt_tokens": prompt, "steps": steps, "busy_s": round(busy, 1), "span_s": round(span, 1),
                "tokens_per_step": round(gen / steps, 1) if steps else None,
                "engine_tok_s": round(gen / busy, 1) if busy else None,
                "busy_fraction": round(busy / span, 3) if span else None}


def run_job(seed: int, args, root: Path) -> dict:
    run_dir = root / f"seed{seed}"
    cmd = [sys.executable, "-m", "trainer_bridge.train", *([f"+experiment={args.experiment}"] if args.experiment else []),
           f"seed={seed}",
           f"trainer.seed={seed}", f"run_dir={run_dir}", "logger.progress=false", "logger.mode=offline",
           *([f"trainer.steps={args.steps}"] if args.steps else []), *args.override]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=open(root / f"seed{seed}.err", "w"),
                            text=True)
    watch, servers = PeakWatch(proc.pid), ServerWatch(proc.pid)
    try:
        out, _ = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    peaks, engine = watch.stop(), servers.stop()
    if run_dir.exists():
        with open(run_dir / "server_scrapes.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in servers.series)
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")] if (run_dir / "metrics.jsonl").exists() else []
    summary = json.loads(out.strip().splitlines()[-1]) if proc.returncode == 0 and out.strip() else {}
    return {"seed": seed, "returncode": proc.returncode, "killed": proc.returncode in (-9, 137) or proc.returncode < 0,
            "minutes": (time.perf_counter() - t0) / 60, "peaks": peaks, "engine": engine, "records": records, "summary": summary}


def series(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records if key in r and r[key] == r[key]]


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def step_seconds(records: list[dict]) -> list[float]:
    walls = series([r for r in records if "reward/mean" in r], "time/wall")
    return [b - a for a, b in zip(walls, walls[1:])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=0, help="override the recipe's trainer.steps")
    p.add_argument("--experiment", default="smollm2_math", help="'' for none: the defaults and --override alone")
    p.add_argument("--override", nargs="*", default=[], help="more riptide-train overrides")
    p.add_argument("--keep", default="", help="keep the runs in this directory")
    args = p.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="riptide_real_"))
    root.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in args.seeds:
        r = run_job(seed, args, root)
        runs.append(r)
        print(f"seed {seed}: exit {r['returncode']}, {r['minutes']:.1f} min, peaks {r['peaks']}, engine {r['engine']}, "
              f"summary {r['summary']}", file=sys.stderr, flush=True)
    records = [rec for r in runs for rec in r["records"]]
    before = [r["summary"].get("val_accuracy_first") for r in runs]
    after = [r["summary"].get("val_accuracy_last") for r in runs]
    worst = max(runs, key=lambda r: r["peaks"].get("sum", 0.0))["peaks"]
    result = {
        "peak_rss_server_gb": round(max(r["peaks"].get("server", 0.0) for r in runs), 2),
        "peak_rss_trainer_gb": round(max(r["peaks"].get("trainer", 0.0) for r in runs), 2),
        "peak_rss_rollout_gb": round(max(r["peaks"].get("rollout", 0.0) for r in runs), 2),
        "peak_rss_sum_gb": round(worst.get("sum", 0.0), 2),
        "step_s_median": median([s for r in runs for s in step_seconds(r["records"])]),
        "step_s_median_per_run": [median(step_seconds(r["records"])) for r in runs],
        "gen_tok_s": median(series(records, "rollout/tokens_per_s")),
        "train_tok_s": median(series(records, "train/trainer_tokens_per_s")),
        "train_s_median": median(series(records, "time/train_s")),
        "wait_s_median": median(series(records, "time/wait_for_data_s")),
        "sync_s_median": median(series(records, "time/weight_sync_s")),
        "engine_tok_s": [r["engine"]["engine_tok_s"] for r in runs],
        "server_busy_fraction": [r["engine"]["busy_fraction"] for r in runs],
        "server_busy_s": [r["engine"]["busy_s"] for r in runs],
        "server_tokens_per_step": [r["engine"]["tokens_per_step"] for r in runs],
        "server_prompt_tokens": [r["engine"]["prompt_tokens"] for r in runs],
        "server_gen_tokens": [r["engine"]["gen_tokens"] for r in runs],
        "heldout_acc_before": before, "heldout_acc_after": after,
        "heldout_acc_delta": [round(a - b, 4) if a is not None and b is not None else None for a, b in zip(after, before)],
        "logprob_abs_diff_mean": median(series(records, "rollout_corr/logprob_abs_diff_mean")),
        "logprob_abs_diff_max": max(series(records, "rollout_corr/logprob_abs_diff_max"), default=None),
        "rollout_corr_kl": median(series(records, "rollout_corr/kl")),
        "killed": any(r["killed"] for r in runs), "exit_codes": [r["returncode"] for r in runs],
        "minutes": [round(r["minutes"], 1) for r in runs], "seeds": args.seeds, "experiment": args.experiment,
        "runs_dir": str(root)}
    sys.stderr.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
