"""Does a run learn and stay learned? 150 steps of the default config on each task, one at a time.

    python bench/stability.py [--tasks copy,reverse,dataset] [--steps 150] [--override trainer.lr=1e-3 ...]

`dataset` is a task of one's own: examples/digit_map.py writes a JSONL of a fixed one-digit mapping
and scores it with its own reward function (task.name=dataset task.path=... task.reward=module:function).
For each task: the best 20-step window of mean reward, the mean reward of the last 20% of steps, and
`holds` = last / best >= 0.9 (the last fifth within 10% of the best window). Last line: one JSON object
with a record per task and `all_hold`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TASKS = {
    "copy": ["task=copy"],
    "reverse": ["task=reverse"],
    "sort": ["task=sort"],
    "add": ["task=add"],
    "dataset": ["task.name=dataset", "task.reward=examples.digit_map:reward", "rollout.max_new_tokens=3"],
}


def criterion(rewards: list[float], window: int = 20) -> dict:
    best = max(sum(rewards[i:i + window]) / window for i in range(len(rewards) - window + 1))
    tail = rewards[-max(1, len(rewards) // 5):]
    last = sum(tail) / len(tail)
    return {"first": round(sum(rewards[:10]) / 10, 3), "best_window": round(best, 3), "last_fifth": round(last, 3),
            "ratio": round(last / best, 3) if best else None, "holds": bool(best) and last >= 0.9 * best}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="copy,reverse,dataset")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--override", action="append", default=[])
    p.add_argument("--keep", default=None, metavar="DIR", help="keep each task's run dir under DIR (default: a temp dir)")
    args = p.parse_args()
    from examples.digit_map import write
    out = {}
    with contextlib.ExitStack() as stack:
        d = args.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="riptide_stability_"))
        data = write(Path(d) / "digit_map.jsonl")
        for task in args.tasks.split(","):
            run_dir = Path(d) / task
            extra = [f"task.path={data}"] if task == "dataset" else []
            cmd = [sys.executable, "-m", "trainer_bridge.train", f"run_dir={run_dir}", f"trainer.steps={args.steps}",
                   f"seed={args.seed}", f"model.path={Path(d) / 'model'}", "logger.wandb=false", "logger.progress=false",
                   *TASKS[task], *extra, *args.override]
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
            if proc.returncode != 0:
                out[task] = {"error": proc.stderr[-500:]}
                continue
            rewards = [json.loads(x)["reward/mean"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            out[task] = {**criterion(rewards), "seconds": json.loads(proc.stdout.strip().splitlines()[-1])["seconds"]}
            print(task, out[task], flush=True)
    print(json.dumps({"tasks": out, "all_hold": all(r.get("holds") for r in out.values()), "steps": args.steps,
                      "overrides": args.override}), flush=True)


if __name__ == "__main__":
    main()
