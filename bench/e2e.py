"""End to end: the same GRPO job, synchronous vs asynchronous, same steps, same seed.

    python bench/e2e.py [--steps 60] [--num-digits 8] [--max-new-tokens 32] [--batch-size 2] [--hidden 384 --layers 4]
                        [--oversample 2] [--threads 1] [--override trainer.lr=1e-3 ...]

sync:  mode=sync (the manager with oversample=1, max_staleness=0): generate a batch, wait, train,
       push weights, and only then generate the next batch.
async: mode=async: oversampling + partial rollout (update_policy abort_furthest, max_staleness 1),
       so the server generates the next batch while the trainer trains and pushes.

The job is composed from configs/ with Hydra's compose API (so the YAML defaults apply), then
overridden. Workload, chosen so generation and training weigh about the same (async can only hide
the smaller of the two): the copy task with 8-digit answers, max_new_tokens 32 and 2 groups of 8 a
batch, on a tiny char model of hidden 384 x 4 layers (default 128 x 2: there generation takes ~10x
the train step, so overlap could hide at most ~10%). A train step costs about its rows x tokens; a
batch's generation about its decode steps (16 rows decode nearly as fast as 64). Until the rollout
manager left the trainer's process the workload was 8 groups and 10 new tokens; the server has got
faster since, which left generation at ~0.42 s against training's ~0.73 s a step (overlap could
then hide at most ~35%); fewer, longer samples put them back level (~0.30 s against ~0.36 s).
60 steps by default (was 30): both runs pay ~7 s to start their server and rollout process and to
stop them, which at 30 steps is a fifth of the async run; a real job runs hundreds of steps. The
JSON's *_steps_seconds (the step loop alone) give the ratio without that cost. The model is built
once into a temp dir, its own path, shared by both runs. The trainer and the server get one torch
thread each (--threads 1): on a 2-core box that gives each its own core, as each has its own device
on a real cluster; with torch's default both would oversubscribe both cores and the overlap would
mostly measure contention.

The last line printed is one JSON object: sync_seconds, async_seconds, speedup (sync/async),
sync_final_reward, async_final_reward (mean reward of the last 10% of steps), max_staleness_seen
(async run), and per-phase mean seconds per step from each run's metrics.jsonl.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PHASES = {"wait_s": "time/wait_for_data_s", "train_s": "time/train_s", "weight_sync_s": "time/weight_sync_s",
          "push_s": "time/push_s"}


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def phase_means(records: list[dict], skip_first: bool = True) -> dict:
    """Mean seconds per step of each phase (step 0 excluded: it pays the first batch's cold start)."""
    rows = records[1:] if skip_first and len(records) > 1 else records
    out = {}
    for name, key in PHASES.items():
        vals = [r[key] for r in rows if key in r]
        out[name] = round(sum(vals) / len(vals), 4) if vals else None
    for name, key in {"tokens_per_s": "rollout/tokens_per_s", "response_len": "response/length_mean",
                      "tokens_aborted": "rollout/tokens_aborted", "tokens_wasted": "rollout/tokens_wasted"}.items():
        vals = [r[key] for r in rows if key in r]
        if name.startswith("tokens_") and name != "tokens_per_s":
            out[name] = vals[-1] if vals else None          # running totals: the last value
        else:
            out[name] = round(sum(vals) / len(vals), 2) if vals else None
    return out


def steps_seconds(records: list[dict]) -> float:
    """Seconds inside the training loop (wait + train + weight sync of every step): no startup."""
    return sum(r.get(PHASES["wait_s"], 0) + r.get(PHASES["train_s"], 0) + r.get(PHASES["weight_sync_s"], 0)
               for r in records)


def run_one(mode: str, args, root: Path, model_path: Path) -> tuple[dict, list[dict], float]:
    from trainer_bridge.run import run
    from trainer_bridge.train import compose_job

    run_dir = root / mode
    overrides = [
        f"mode={mode}", f"seed={args.seed}", f"run_dir={run_dir}",
        f"model.path={model_path}", f"model.hidden={args.hidden}", f"model.layers={args.layers}",
        f"task.name={args.task}", f"task.num_digits={args.num_digits}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.batch_size={args.batch_size}",
        f"rollout.oversample={args.oversample}", f"rollout.max_staleness={args.max_staleness}",
        f"rollout.update_policy={args.update_policy}",
        f"trainer.steps={args.steps}", f"trainer.seed={args.seed}",
        "logger.wandb=false", "logger.progress=false",
        *args.override,
    ]
    job = compose_job(overrides)
    t0 = time.perf_counter()
    result = run(job)
    wall = time.perf_counter() - t0
    return result, read_metrics(run_dir), wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--task", default="copy")
    p.add_argument("--hidden", type=int, default=384, help="tiny model hidden size (configs/: 128)")
    p.add_argument("--layers", type=int, default=4, help="tiny model layers (configs/: 2)")
    p.add_argument("--num-digits", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=2, help="groups a step (configs/: 8)")
    p.add_argument("--oversample", type=float, default=2.0)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--update-policy", default="abort_furthest")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--order", default="sync,async", help="run order, e.g. async,sync")
    p.add_argument("--override", action="append", default=[], help="extra Hydra override (repeatable)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the trainer and of each server (0: torch's default, all cores each)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (run dirs, server logs)")
    args = p.parse_args()

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("WANDB_MODE", "disabled")
    if args.threads > 0:
        # The trainer and the server each get their own cores, as they get their own devices on a real
        # cluster; the servers inherit the environment.
        import torch
        torch.set_num_threads(args.threads)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(args.threads)
    root = Path(tempfile.mkdtemp(prefix="riptide_e2e_"))
    model_path = root / "model"

    results = {}
    try:
        for mode in args.order.split(","):
            result, records, wall = run_one(mode, args, root, model_path)
            results[mode] = (result, records, wall)
            print(f"{mode}: {wall:.1f}s  first_reward={result['first_reward']}  last_reward={result['last_reward']}  "
                  f"phases/step={phase_means(records)}", flush=True)
    finally:
        if not args.keep:
            import shutil
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"run dirs kept in {root}", flush=True)

    (rs, ms, ws), (ra, ma, wa) = results["sync"], results["async"]
    out = {
        "sync_seconds": round(rs["seconds"], 2), "async_seconds": round(ra["seconds"], 2),
        "speedup": round(rs["seconds"] / ra["seconds"], 3) if ra["seconds"] else None,
        "sync_final_reward": rs["last_reward"], "async_final_reward": ra["last_reward"],
        "max_staleness_seen": max((r.get("max_staleness", 0) for r in ma), default=None),
        "sync_first_reward": rs["first_reward"], "async_first_reward": ra["first_reward"],
        "sync_wall_seconds": round(ws, 2), "async_wall_seconds": round(wa, 2),
        "sync_steps_seconds": round(steps_seconds(ms), 2), "async_steps_seconds": round(steps_seconds(ma), 2),
        "steps_speedup": round(steps_seconds(ms) / steps_seconds(ma), 3) if steps_seconds(ma) else None,
        "sync_phase_mean_s": phase_means(ms), "async_phase_mean_s": phase_means(ma),
        "sync_drops": ms[-1].get("drops", {}) if ms else {},
        "async_drops": ma[-1].get("drops", {}) if ma else {},
        "params": {"steps": args.steps, "task": args.task, "num_digits": args.num_digits, "hidden": args.hidden, "layers": args.layers,
                   "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "oversample": args.oversample,
                   "max_staleness": args.max_staleness, "update_policy": args.update_policy, "seed": args.seed,
                   "order": args.order, "threads": args.threads, "overrides": args.override, "cpus": os.cpu_count()},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
