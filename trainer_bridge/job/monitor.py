"""What a run shows: wandb (offline unless logged in), a progress bar, metrics.jsonl and a PNG."""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from trainer_bridge.config import LoggerConfig


def native_logs_to(path: Path) -> None:
    """Send what native libraries write to stderr (Mooncake's glog lines: `I1130 ... listen on
    port`, `E1130 ... Local segment descriptor not found`) to `path`, not the console. Python's own
    stderr (tracebacks, warnings, the progress bar) stays on the console: it moves to a copy of the
    original descriptor, and processes started from here get that copy too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    console = os.dup(2)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 2)
    os.close(log)
    os.set_inheritable(console, True)
    sys.stderr = os.fdopen(console, "w", buffering=1, closefd=False)
    import logging
    for handler in logging.getLogger().handlers:       # Hydra's console handler, if any
        if isinstance(handler, logging.StreamHandler) and getattr(handler.stream, "fileno", None):
            try:
                if handler.stream.fileno() == 2:
                    handler.setStream(sys.stderr)
            except (OSError, ValueError):
                pass


def wandb_mode(cfg: LoggerConfig) -> str:
    if not cfg.wandb or cfg.mode == "disabled":
        return "disabled"
    if cfg.mode != "auto":
        return cfg.mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    logged_in = bool(os.environ.get("WANDB_API_KEY")) or (Path.home() / ".netrc").exists() and \
        "api.wandb.ai" in (Path.home() / ".netrc").read_text(errors="ignore")
    return "online" if logged_in else "offline"


class Monitor:
    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: dict, total_steps: int, first_step: int = 0):
        """`config`: the job's, as a dict; with its weight_sync.audit, every trained sample also goes
        to trained.jsonl, a line per step."""
        self.cfg, self.run_dir, self.config = cfg, Path(run_dir), config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.history = self._earlier_steps(first_step)
        self.jsonl = _Lines(self.run_dir / "metrics.jsonl")
        self.trained = None
        if isinstance(config, dict) and config.get("weight_sync", {}).get("audit"):
            _keep_steps_before(self.run_dir / "trained.jsonl", first_step)
            self.trained = _Lines(self.run_dir / "trained.jsonl")
        self.run = None
        mode = wandb_mode(cfg)
        if mode != "disabled":
            import wandb
            self.run = wandb.init(project=cfg.project, dir=str(self.run_dir), mode=mode, config=config,
                                  resume="allow", id=self._run_id())
        # matplotlib's import (~0.5 s) happens while the servers start, not at the end of the run.
        threading.Thread(target=_import_pyplot, name="import-matplotlib", daemon=True).start()
        self.bar = None
        if cfg.progress:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=first_step, desc="grpo", unit="step", dynamic_ncols=True)

    def _earlier_steps(self, first_step: int) -> list[dict]:
        """A resumed run keeps the steps before its checkpoint (its curve is the whole run's) and
        drops the ones logged after it, which it is about to run again."""
        return _keep_steps_before(self.run_dir / "metrics.jsonl", first_step)

    def warn(self, message: str) -> None:
        """Loud: on the console above the progress bar and in wandb's summary (the warn/* metrics
        chart how long it has held)."""
        self._say(f"riptide WARNING: {message}", "warnings", message)

    def note(self, message: str, console: bool = True) -> None:
        """Worth knowing, not wrong: on the console (unless `console` is False) and in wandb's summary."""
        self._say(f"riptide: {message}" if console else None, "notes", message)

    def _say(self, line: str | None, summary_key: str, message: str) -> None:
        """`line` on the console (above the progress bar, if any); `message` appended to the wandb
        summary's `summary_key` list."""
        if line is None:
            pass
        elif self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)
        if self.run is not None:
            self.run.summary[summary_key] = [*self.run.summary.get(summary_key, []), message]

    def _run_id(self) -> str:
        path = self.run_dir / "wandb_run_id"
        if not path.exists():
            import uuid
            path.write_text(uuid.uuid4().hex[:12])
        return path.read_text().strip()

    @property
    def wandb_dir(self) -> str:
        return str(Path(self.run.dir).parent) if self.run is not None else ""

    def log(self, step: int, metrics: dict, samples: list | None = None) -> None:
        flat = {"time/wall": time.time(), **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
        record = {"step": step, **flat, "staleness_hist": metrics.get("staleness_hist", {}),
                  "drops": metrics.get("drops", {})}
        self.history.append(record)
        self.jsonl.append(record)
        if self.trained is not None:
            self.trained.append({"step": step, "samples": [trained_record(s) for s in samples or []]})
        if self.run is not None:
            import wandb
            payload = dict(flat)
            for k, v in metrics.get("drops", {}).items():
                payload[f"rollout/drops/{k}"] = v
            hist = metrics.get("staleness_hist", {})
            if hist:
                payload["rollout/staleness"] = wandb.Histogram(
                    np_histogram=([hist[k] for k in sorted(hist)], [*sorted(hist), max(hist) + 1]))
            if samples and self.cfg.log_samples:
                table = wandb.Table(columns=["prompt", "response", "reward", "versions"])
                for s in samples[:self.cfg.log_samples]:
                    table.add_data(s.prompt if isinstance(s.prompt, str) else json.dumps(s.prompt), s.response_text, s.reward, str(sorted(set(s.versions))))
                payload["samples"] = table
            self.run.log(payload, step=step)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{flat.get('reward/mean', 0):.3f}", stale=metrics.get("staleness_max", 0))

    def log_validation(self, step: int, metrics: dict) -> None:
        """A validation row of its own (the final weights'), in metrics.jsonl and wandb."""
        record = {"step": step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
        self.history.append(record)
        self.jsonl.append(record)
        if self.run is not None:
            self.run.log({k: v for k, v in record.items() if k != "step"}, step=step)

    def finish(self) -> str:
        if self.bar is not None:
            self.bar.close()
        plot = self.plot()
        self.jsonl.close()
        if self.trained is not None:
            self.trained.close()
        if self.run is not None:
            self.run.finish()
        return plot

    def plot(self) -> str:
        """curves.png: reward and accuracy (raw and smoothed), response length, staleness and
        throughput, over the whole run (a resumed run included), titled with the task and the run."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        h = self.history
        steps = [r["step"] for r in h]

        def series(key: str) -> list[float]:
            return [r.get(key, float("nan")) for r in h]

        def smooth(values: list[float], k: int = 10) -> list[float]:
            out, window = [], []
            for v in values:
                window = (window + [v])[-k:]
                out.append(sum(window) / len(window))
            return out

        fig, ((a, b, e), (c, d, g)) = plt.subplots(2, 3, figsize=(17, 7.5))
        # Fixed margins: tight_layout measured every label first, most of the plot's ~0.4 s.
        fig.subplots_adjust(left=0.045, right=0.99, bottom=0.07, top=0.92, wspace=0.18, hspace=0.3)
        for key, label, color in (("reward/mean", "reward", "C0"), ("reward/accuracy", "accuracy", "C1")):
            values = series(key)
            a.plot(steps, values, color=color, alpha=0.3, linewidth=1)
            a.plot(steps, smooth(values), color=color, label=f"{label} (10-step mean)")
        a.set(xlabel="step", ylabel="reward / accuracy", title="reward")
        b.plot(steps, series("response/length_mean"), label="mean response length")
        b.set(xlabel="step", ylabel="tokens", title="response length")
        c.plot(steps, series("staleness_max"), label="max staleness observed (versions)", drawstyle="steps-post")
        c.plot(steps, series("rollout/inflight"), label="requests in flight", alpha=0.6)
        c.set(xlabel="step", title="staleness and in-flight requests")
        d.plot(steps, series("rollout/tokens_per_s"), label="generated tokens/s (servers)")
        d.plot(steps, series("train/trainer_tokens_per_s"), label="trained tokens/s (trainer)")
        d.set(xlabel="step", ylabel="tokens/s", title="throughput")
        for key, label in (("val/accuracy", "held-out accuracy (greedy)"), ("val/reward_mean", "held-out reward (greedy)")):
            points = [(r["step"], r[key]) for r in h if key in r]
            e.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label)
        e.set(xlabel="step (weights after it)", ylabel="accuracy / reward", title="validation")
        for key, label in (("rollout_corr/logprob_abs_diff_mean", "|logprob diff| mean"),
                           ("rollout_corr/kl", "KL(server || trainer) a token")):
            g.plot(steps, series(key), label=label)
        g.set(xlabel="step", title="server vs trainer logprobs (tokens of the trained version)")
        for ax in (a, b, c, d, e, g):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        task = self.config.get("task", {}).get("name", "?") if isinstance(self.config, dict) else "?"
        fig.suptitle(f"{task} - {self.run_dir.name} (steps {steps[0] if steps else 0}-{steps[-1] if steps else 0})")
        path = self.run_dir / "curves.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return str(path)


class _Lines:
    """A JSON-lines file that others read while it grows: each record goes out in one write(2) on an
    O_APPEND descriptor, so a reader sees whole lines or an unterminated tail (read_rows skips it),
    never a line cut mid-record by a buffer flush."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, record: dict) -> None:
        data = (json.dumps(record) + "\n").encode()
        while data:
            data = data[os.write(self.fd, data):]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def read_rows(path) -> list[dict]:
    """The records of a JSON-lines file another process may be writing: only newline-ended lines."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines() if line]


def _keep_steps_before(path: Path, first_step: int) -> list[dict]:
    """The records of a per-step JSON-lines file before `first_step` (a resumed run runs the later
    ones again); the file is cut to them. A torn last line (a killed run) is dropped."""
    if not path.exists():
        return []
    text = path.read_text()
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    kept = [r for r in records if r.get("step", 0) < first_step]
    if len(kept) != len(records) or (text and not text.endswith("\n")):
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return kept


def trained_record(sample) -> dict:
    """What an audit needs of a trained sample: which prompt draw it is (its group), the weight
    version of each generated token (as runs: [version, count]) and where and when its requests ran."""
    runs: list[list[int]] = []
    for v, m in zip(sample.versions, sample.loss_mask):
        if not m:
            continue
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return {"group": sample.group_id, "index": sample.index, "uid": sample.uid, "versions": runs,
            "segments": sample.segments}


def _import_pyplot() -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401
