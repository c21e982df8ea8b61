"""End to end: the same GRPO job, synchronous vs asynchronous, same steps, same seeds.

    python bench/e2e.py [--workloads copy,copy_varlen,copy_batch8] [--seeds 0,1,2,3,4] [--steps N]
                        [--num-digits 8] [--max-new-tokens 32] [--batch-size 2] [--hidden 384 --layers 4]
                        [--oversample 2] [--threads 1] [--lr 5e-4] [--override trainer.off_policy=decoupled ...]

Every workload runs sync and async on every seed (the seed sets the data order, the sampling and the
trainer's RNG; the random model is the same for all), so learning is compared over seeds, strictly
(issue #30): each seed's final reward (the mean reward of a run's last 10% of steps), async's mean
over sync's (`async_over_sync_reward`, to be >= 0.95) and the worst async seed over sync's mean
(`worst_async_seed_over_sync_mean`, >= 0.7: an async seed that collapses shows here, where a
criterion on means and spreads let a wide async spread pass).

sync:  mode=sync (the manager with oversample=1, max_staleness=0): generate a batch, wait, train,
       push weights, and only then generate the next batch.
async: mode=async: oversampling + partial rollout (update_policy abort_furthest, max_staleness 1),
       so the server generates the next batch while the trainer trains and pushes (and each push
       streams while the trainer's next forward and backward passes run: weight_sync.overlap);
       the trainer's samples are one version behind, and the loss corrects them by trainer.off_policy
       (behaviour_clip by default; docs/configuration.md, "Off-policy correction").

Workloads (the copy task: partial credit, so a response longer than the answer scores at most
answer/length, and stopping right is most of the reward):
- copy: 8-digit answers, 2 groups of 8 a step, 100 steps;
- copy_varlen: 2-16 digits, so correct answers run from 3 to 17 tokens and the long ones are the
  hard ones (a run that trained on fewer long samples would learn them worse);
- copy_batch8: copy with 8 groups a step (64 samples), a less noisy gradient as in a real run's
  batches; 80 steps (640 groups against the others' 200), where sync levels off. Async starts a few
  steps behind on it (Adam's first updates, docs/off_policy.md): `async_over_sync_reward_at_half`
  is the ratio at step 40, mid-climb, where that lag weighs most.
max_new_tokens 32, a tiny char model of hidden 384 x 4 layers, chosen so generation and training
weigh about the same (async can only hide the smaller of the two). The trainer and the server get
one torch thread each (--threads 1): on a 2-core box that gives each its own core, as each has its
own device on a real cluster.

The learning rate is 5e-4 (--lr), half the configs' 1e-3. One step moves this tiny model's policy by
~0.005-0.01 nats a token once learning settles, and by 0.1-0.3 in the first steps (Adam's first
updates): an LLM run at lr ~1e-6 moves far less. The JSON gives it per workload
(`policy_kl_per_token`: KL k3 a token between the weights that sampled the async run's tokens and
the trainer's, i.e. between consecutive policies), so this is the stress case for off-policy
correction; run with a smaller --lr to see the gap at gentler steps.

The wall-time speedup depends on what the runs learn, not only on the overlap: a step costs about
its response lengths, and a run that learns to stop early gets cheaper steps. `speedup` is the
median seed's (sync seconds / async seconds); `steps_speedups` is the step loop alone, without the
~6 s each run pays to start its server and rollout process. `sync_reward_at_async_seconds_mean` is
the sync run's reward after as much step-loop time as the whole async run took (learning per
second, where the final rewards compare learning per step).

The last line printed is one JSON object. At its top the criterion per workload
(`sync_final_rewards`, `async_final_rewards`, `async_over_sync_reward`,
`worst_async_seed_over_sync_mean`, `policy_kl_per_token`, `speedups`) and, for the first workload
(copy), `speedup` and the older keys (means, stds, pooled_std, seconds). Under "tasks", everything
per workload: each seed's figures, the reward curves (mean over the seeds, in blocks of
--curve-every steps), mean response lengths, drops, max staleness, per-phase seconds a step, and the
off-policy trace of each mode (`*_trace`: entropy, the truncated / out-of-band token shares, the
behaviour KL, grad norm, response length, averaged over steps and seeds). --keep keeps every run's
metrics.jsonl for per-step traces. Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
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


# A workload: its Hydra overrides. copy is the speed workload (see above); copy_varlen is the one
# where length matters: 2..16 digits to copy, so correct answers run from 3 to 17 tokens and the long
# ones are the hard ones (a run that trained on fewer long samples would learn them worse).
# copy_batch8 is copy with 8 groups a step (64 samples) where the others take 2: the gradient of a
# step is less noisy, as in a real run's batches, and a step costs ~3x as much, so it runs 80 steps
# (640 groups, against the others' 200): long enough for sync to level off (~0.22 from step ~50).
# At 40 steps it ended mid-climb, where async's lag of a few steps (made in Adam's first updates,
# docs/off_policy.md) was most of the difference; `*_reward_at_half` keeps that point in view.
WORKLOADS = {
    "copy": lambda a: ["task.name=copy", f"task.num_digits={a.num_digits}", "task.min_digits=0"],
    "copy_varlen": lambda a: ["task.name=copy", "task.num_digits=16", "task.min_digits=2"],
    "copy_batch8": lambda a: ["task.name=copy", f"task.num_digits={a.num_digits}", "task.min_digits=0"],
}
# per workload: (groups a step, steps); None takes --batch-size / --steps
SHAPES = {"copy_batch8": (8, 80)}


def shape(workload: str, args) -> tuple[int, int]:
    batch, steps = SHAPES.get(workload, (None, None))
    if args.steps_set:                       # --steps given: every workload runs that many
        steps = args.steps
    return batch or args.batch_size, steps or args.steps


def run_one(mode: str, workload: str, seed: int, args, root: Path, model_path: Path) -> tuple[dict, list[dict], float]:
    from trainer_bridge.job.run import run
    from trainer_bridge.train import compose_job

    run_dir = root / f"{workload}-{seed}-{mode}"
    batch_size, steps = shape(workload, args)
    overrides = [
        f"mode={mode}", f"seed={seed}", f"run_dir={run_dir}",
        f"model.path={model_path}", f"model.hidden={args.hidden}", f"model.layers={args.layers}",
        *WORKLOADS[workload](args),
        f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.batch_size={batch_size}",
        f"rollout.oversample={args.oversample}", f"rollout.max_staleness={args.max_staleness}",
        f"rollout.update_policy={args.update_policy}",
        f"trainer.steps={steps}", f"trainer.seed={seed}", f"trainer.lr={args.lr}",
        "logger.wandb=false", "logger.progress=false",
        *args.override,
    ]
    job = compose_job(overrides)
    t0 = time.perf_counter()
    result = run(job)
    wall = time.perf_counter() - t0
    return result, read_metrics(run_dir), wall


TRACE = {"entropy": "train/entropy", "tis_weight": "train/tis_weight_mean",
         "tis_truncated_frac": "train/tis_truncated_frac", "is_masked_frac": "train/is_masked_frac",
         "behaviour_kl": "train/logprob_kl_k3", "grad_norm": "train/grad_norm",
         "response_len": "response/length_mean"}


def mean_of(pairs: list[dict], mode: str, key: str) -> float | None:
    vals = [r[key] for p in pairs for r in p[mode]["records"][1:] if key in r]
    return round(statistics.fmean(vals), 4) if vals else None


def mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def seed_phase_means(pairs: list[dict], mode: str) -> dict:
    """Each seed's per-phase means (phase_means), averaged over the seeds."""
    per = [phase_means(p[mode]["records"]) for p in pairs]
    return {k: (round(statistics.fmean(x[k] for x in per), 4) if all(x[k] is not None for x in per) else None)
            for k in per[0]}


def curve(runs: list[list[dict]], every: int) -> list[float]:
    """Mean reward per step over the seeds, averaged over blocks of `every` steps."""
    steps = min(len(r) for r in runs)
    per_step = [sum(r[i]["reward/mean"] for r in runs) / len(runs) for i in range(steps)]
    return [round(sum(per_step[i:i + every]) / len(per_step[i:i + every]), 4) for i in range(0, steps, every)]


def window_mean(rows: list[dict], end: int) -> float:
    """The mean reward of the 10% of a run's steps that end at step `end` (as the final reward is)."""
    k = max(1, len(rows) // 10)
    window = rows[max(0, end - k):max(end, 1)]
    return sum(r["reward/mean"] for r in window) / len(window)


def summarize(pairs: list[dict], every: int) -> dict:
    """One workload's runs over the seeds: final-reward means and spreads, curves, speedups."""
    out = {}
    for mode in ("sync", "async"):
        finals = [p[mode]["result"]["last_reward"] for p in pairs]
        m, sd = mean_std(finals)
        out[f"{mode}_final_reward_mean"], out[f"{mode}_final_reward_std"] = round(m, 4), round(sd, 4)
        out[f"{mode}_final_rewards"] = finals
        # the same reward halfway: the mean over the 10% of steps up to the middle of the run
        half = [window_mean(p[mode]["records"], len(p[mode]["records"]) // 2) for p in pairs]
        out[f"{mode}_reward_at_half"] = round(statistics.fmean(half), 4)
    out["async_over_sync_reward_at_half"] = round(out["async_reward_at_half"] / (out["sync_reward_at_half"] or 1e-9), 4)
    sync_mean = out["sync_final_reward_mean"] or 1e-9
    out["async_over_sync_reward"] = round(out["async_final_reward_mean"] / sync_mean, 4)
    out["worst_async_seed_over_sync_mean"] = round(min(out["async_final_rewards"]) / sync_mean, 4)
    pooled = ((out["sync_final_reward_std"] ** 2 + out["async_final_reward_std"] ** 2) / 2) ** 0.5
    out["pooled_std"] = round(pooled, 4)
    out["async_within_pooled_std"] = out["async_final_reward_mean"] >= out["sync_final_reward_mean"] - pooled
    speedups = [p["sync"]["result"]["seconds"] / p["async"]["result"]["seconds"] for p in pairs]
    out["speedups"] = [round(x, 3) for x in speedups]
    out["speedup"] = round(sorted(speedups)[len(speedups) // 2], 3)            # the median seed
    out["sync_seconds"] = [round(p["sync"]["result"]["seconds"], 1) for p in pairs]
    out["async_seconds"] = [round(p["async"]["result"]["seconds"], 1) for p in pairs]
    out["steps_speedups"] = [round(steps_seconds(p["sync"]["records"]) / steps_seconds(p["async"]["records"]), 3)
                             for p in pairs]
    for mode in ("sync", "async"):
        out[f"{mode}_reward_curve"] = curve([p[mode]["records"] for p in pairs], every)
        out[f"{mode}_response_len"] = round(mean_std([phase_means(p[mode]["records"])["response_len"] or 0
                                                      for p in pairs])[0], 2)
    # per wall time: the sync run's reward when it had run as long (in its step loop) as the whole
    # async step loop took; the mean of the 10% of steps up to there, as the final reward is
    at_time = []
    for p in pairs:
        budget = steps_seconds(p["async"]["records"])
        rows, spent = p["sync"]["records"], 0.0
        end = len(rows)
        for i, r in enumerate(rows):
            spent += r.get(PHASES["wait_s"], 0) + r.get(PHASES["train_s"], 0) + r.get(PHASES["weight_sync_s"], 0)
            if spent >= budget:
                end = i + 1
                break
        at_time.append(round(window_mean(rows, end), 4))
    out["sync_reward_at_async_seconds"] = at_time
    out["sync_reward_at_async_seconds_mean"] = round(sum(at_time) / len(at_time), 4)
    # how far one step moves the policy, seen by the async run: KL (k3, a token) between the weights
    # that sampled a token (one version back) and the trainer's before its step
    kls = [r["train/logprob_kl_k3"] for p in pairs for r in p["async"]["records"][1:] if "train/logprob_kl_k3" in r]
    out["async_behaviour_kl_per_token"] = round(sum(kls) / len(kls), 4) if kls else None
    # the same, as the issue names it: between consecutive policies (the async run's tokens are one
    # version behind the trainer that trains on them)
    out["policy_kl_per_token"] = out["async_behaviour_kl_per_token"]
    for mode in ("sync", "async"):      # the off-policy trace, averaged over steps and seeds
        out[f"{mode}_trace"] = {name: mean_of(pairs, mode, key) for name, key in TRACE.items()}
    out["async_drops"] = [p["async"]["records"][-1].get("drops", {}) for p in pairs]
    out["max_staleness_seen"] = max(r.get("staleness_max", 0) for p in pairs for r in p["async"]["records"])
    out["async_phase_mean_s"] = seed_phase_means(pairs, "async")
    out["sync_phase_mean_s"] = seed_phase_means(pairs, "sync")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="steps of every workload (default: 100, copy_batch8 80)")
    p.add_argument("--workloads", default="copy,copy_varlen,copy_batch8",
                   help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated: each workload runs sync and async on each")
    p.add_argument("--hidden", type=int, default=384, help="tiny model hidden size (configs/: 128)")
    p.add_argument("--layers", type=int, default=4, help="tiny model layers (configs/: 2)")
    p.add_argument("--num-digits", type=int, default=8, help="copy's digits")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=2, help="groups a step (configs/: 8)")
    p.add_argument("--oversample", type=float, default=2.0)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--update-policy", default="abort_furthest")
    p.add_argument("--lr", type=float, default=5e-4,
                   help="both modes' learning rate (configs/: 1e-3; why 5e-4 here: the docstring)")
    p.add_argument("--order", default="sync,async",
                   help="run order within a seed, e.g. async,sync; one mode alone prints only its final rewards")
    p.add_argument("--curve-every", type=int, default=5, help="steps per point of the reward curves")
    p.add_argument("--override", action="append", default=[], help="extra Hydra override (repeatable)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the trainer and of each server (0: torch's default, all cores each)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (run dirs, server logs)")
    args = p.parse_args()
    args.steps_set = args.steps is not None
    args.steps = args.steps if args.steps_set else 100
    workloads = args.workloads.split(",")
    seeds = [int(x) for x in args.seeds.split(",")]
    for w in workloads:
        if w not in WORKLOADS:
            p.error(f"--workloads: {w!r} is not one of {', '.join(WORKLOADS)}")

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
    model_path = root / "model"      # one random model for every run: the seeds vary the sampling and data

    by_workload: dict[str, list[dict]] = {w: [] for w in workloads}
    try:
        for w in workloads:
            for seed in seeds:
                pair = {}
                for mode in args.order.split(","):
                    result, records, wall = run_one(mode, w, seed, args, root, model_path)
                    pair[mode] = {"result": result, "records": records, "wall": wall}
                    print(f"{w} seed {seed} {mode}: {result['seconds']:.1f}s  first_reward={result['first_reward']}  "
                          f"last_reward={result['last_reward']}  phases/step={phase_means(records)}", file=sys.stderr,
                          flush=True)
                by_workload[w].append(pair)
    finally:
        if not args.keep:
            import shutil
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"run dirs kept in {root}", file=sys.stderr, flush=True)

    if sorted(args.order.split(",")) != ["async", "sync"]:     # one mode only (a screen): each seed's final reward
        print(json.dumps({"final_rewards": {w: {mode: [p[mode]["result"]["last_reward"] for p in pairs]
                                                for mode in args.order.split(",")}
                                            for w, pairs in by_workload.items()}}), flush=True)
        return
    tasks = {w: summarize(pairs, args.curve_every) for w, pairs in by_workload.items()}
    head = tasks[workloads[0]]
    pairs = by_workload[workloads[0]]
    drops: dict = {}
    for d in head["async_drops"]:
        for k, v in d.items():
            drops[k] = drops.get(k, 0) + v

    def mean(xs) -> float:
        return round(statistics.fmean(xs), 4)

    out = {
        "speedup": head["speedup"],
        # the keys of the one-seed version (issue #14), over the first workload's seeds: means, and
        # the median seed's step-loop ratio
        "sync_seconds": mean(head["sync_seconds"]), "async_seconds": mean(head["async_seconds"]),
        "steps_speedup": sorted(head["steps_speedups"])[len(pairs) // 2],
        "sync_final_reward": head["sync_final_reward_mean"], "async_final_reward": head["async_final_reward_mean"],
        "sync_first_reward": mean([p["sync"]["result"]["first_reward"] for p in pairs]),
        "async_first_reward": mean([p["async"]["result"]["first_reward"] for p in pairs]),
        "sync_wall_seconds": mean([p["sync"]["wall"] for p in pairs]),
        "async_wall_seconds": mean([p["async"]["wall"] for p in pairs]),
        "max_staleness_seen": head["max_staleness_seen"],
        "sync_phase_mean_s": head["sync_phase_mean_s"], "async_phase_mean_s": head["async_phase_mean_s"],
        "async_drops": drops,
        **{k: head[k] for k in ("sync_final_reward_mean", "async_final_reward_mean", "sync_final_reward_std",
                                "async_final_reward_std", "pooled_std", "async_within_pooled_std",
                                "sync_reward_at_async_seconds_mean")},
        "seeds": seeds, "workload": workloads[0],
        # the strict criterion (issue #30), per workload: every seed's final reward, async's mean over
        # sync's, and the worst async seed over sync's mean
        **{key: {w: t[key] for w, t in tasks.items()}
           for key in ("sync_final_rewards", "async_final_rewards", "async_over_sync_reward",
                       "worst_async_seed_over_sync_mean", "policy_kl_per_token", "async_over_sync_reward_at_half")},
        "speedups": {w: t["speedup"] for w, t in tasks.items()},
        "tasks": tasks,
        "params": {"steps": args.steps, "workloads": workloads, "num_digits": args.num_digits, "hidden": args.hidden,
                   "layers": args.layers, "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
                   "oversample": args.oversample, "max_staleness": args.max_staleness,
                   "update_policy": args.update_policy, "order": args.order, "threads": args.threads, "lr": args.lr,
                   "overrides": args.override, "cpus": os.cpu_count(), "curve_every": args.curve_every,
                   "steps_by_workload": {w: shape(w, args)[1] for w in workloads}},
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
