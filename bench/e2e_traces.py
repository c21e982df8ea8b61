"""Per-step traces of kept e2e runs, sync next to async, as one figure (docs/off_policy.png); or the
reward curves of bench/e2e.py's JSON lines, one panel per workload (docs/e2e_curves.png).

    python bench/e2e.py --workloads copy --keep ...        # prints: run dirs kept in DIR
    python bench/e2e_traces.py --out docs/off_policy.png NAME=DIR [NAME=DIR ...]
    python bench/e2e_traces.py --curves RUN1.json [RUN2.json ...] --out docs/e2e_curves.png

Each NAME=DIR is a directory of run dirs (`copy-<seed>-<mode>/metrics.jsonl`, as bench/e2e.py --keep
leaves them): one curve per NAME and mode, the mean over its seeds, smoothed over --smooth steps. Rows:
the reward of the scored groups, response length, entropy, and the KL a token between the weights
that sampled the tokens and the trainer's (0 for sync), its largest value over the seeds dashed.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ROWS = [("reward/mean", "reward (scored groups)"), ("response/length_mean", "response length"),
        ("train/entropy", "entropy"), ("train/logprob_kl_k3", "behaviour -> trainer KL a token")]


def load(directory: Path, workload: str) -> dict[str, list[list[dict]]]:
    """{mode: [one list of step records per seed]} of the run dirs in `directory`."""
    out: dict[str, list[list[dict]]] = {}
    for run in sorted(directory.glob(f"{workload}-*-*")):
        mode = run.name.rsplit("-", 1)[1]
        path = run / "metrics.jsonl"
        if path.exists():
            out.setdefault(mode, []).append([json.loads(x) for x in path.read_text().splitlines() if x.strip()])
    return out


def smoothed(runs: list[list[dict]], key: str, every: int, reduce=statistics.fmean) -> tuple[list[int], list[float]]:
    steps = min(len(r) for r in runs)
    xs, ys = [], []
    for start in range(0, steps, every):
        vals = [r[i][key] for r in runs for i in range(start, min(start + every, steps)) if key in r[i]]
        if vals:
            xs.append(start)
            ys.append(reduce(vals))
    return xs, ys


def plot_curves(paths: list[str], out: str, plt) -> None:
    """Each workload's sync and async reward curves (mean over the seeds), one line per JSON file."""
    runs = [json.loads(Path(x).read_text().strip().splitlines()[-1]) for x in paths]
    workloads = list(runs[0]["tasks"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.2), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        every = runs[0]["params"].get("curve_every", 5)
        for i, run in enumerate(runs):
            task = run["tasks"][w]
            for mode, colour in (("sync", "tab:blue"), ("async", "tab:orange")):
                ys = task[f"{mode}_reward_curve"]
                ax.plot([k * every for k in range(len(ys))], ys, color=colour, alpha=0.8,
                        label=f"{mode}" if i == 0 else None, linestyle=("-", "--", ":")[i % 3])
        ax.set_title(f"{w} ({len(runs[0]['seeds'])} seeds, {len(runs)} runs)", fontsize=9)
        ax.set_xlabel("step")
    axes[0][0].set_ylabel("reward (mean over seeds)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", help="NAME=DIR")
    p.add_argument("--curves", nargs="+", help="bench/e2e.py output files (their last line is the JSON)")
    p.add_argument("--workload", default="copy")
    p.add_argument("--smooth", type=int, default=5)
    p.add_argument("--out", default="docs/off_policy.png")
    args = p.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if args.curves:
        plot_curves(args.curves, args.out, plt)
        print(json.dumps({"out": args.out}))
        return
    fig, axes = plt.subplots(len(ROWS), 1, figsize=(9, 2.4 * len(ROWS)), sharex=True)
    colours = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"])
    for spec in args.runs:
        name, directory = spec.split("=", 1)
        for mode, runs in load(Path(directory), args.workload).items():
            label, colour = f"{name} ({mode}, {len(runs)} seeds)", next(colours)
            for ax, (key, title) in zip(axes, ROWS):
                if key == "train/logprob_kl_k3" and mode == "sync":
                    continue
                ax.plot(*smoothed(runs, key, args.smooth), label=label, color=colour)
                if key == "train/logprob_kl_k3":
                    ax.plot(*smoothed(runs, key, args.smooth, max), linestyle="--", color=colour, alpha=0.6)
                ax.set_ylabel(title, fontsize=8)
    axes[-1].set_yscale("log")
    axes[-1].set_xlabel("step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(json.dumps({"out": args.out}))


if __name__ == "__main__":
    main()
