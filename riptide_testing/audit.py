"""An audit of a finished GRPO job from what it left behind (bench/chaos.py; `weight_sync.audit=true`).

It reads only the run directory: metrics.jsonl (steps, rewards), trained.jsonl (each trained sample:
its prompt draw, its tokens' weight versions, where and when its requests ran), the last
checkpoint's rollout_state.json (how far the data was drawn, the groups dropped and why, the groups
held for a resume), logs/pushes.jsonl (every push the trainer started: version, update id, digest)
and logs/commits-*.jsonl (every commit of every server: version, update id, digest of the weights
that served from then on, when). A resumed run rewrites the steps after its checkpoint, so these
describe the run's one history, whatever crashed on the way. The checks:

  * every prompt drawn is trained exactly once (each of its group's samples once), or dropped with
    a reason, or held in the last checkpoint: `samples_lost`, `samples_duplicated`;
  * every version a server served came from a push the trainer started, with the trainer's digest
    of those weights: `served_uncommitted`, `digest_mismatches`;
  * every trained token's version is one its server was serving while the request that generated
    it ran: `tokens_off_timeline`;
  * the job completed its steps, and the reward of the last fifth against the first.
"""
from __future__ import annotations

import bisect
import collections
import glob
import json
from pathlib import Path

from trainer_bridge.config import latest_checkpoint


def read_records(path) -> list[dict]:
    """Every whole record of a JSON-lines file (a line a killed writer left torn is left out; a file
    not there has none)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class Timeline:
    """What one server URL served over time: its load and commit records, in order (a port that a
    later server reuses carries on the same timeline, as the two never ran at once)."""

    def __init__(self, records: list[dict]):
        self.records = sorted(records, key=lambda r: r["t_start"])
        self.starts = [r["t_start"] for r in self.records]

    def served_during(self, version: int, t0: float, t1: float) -> dict | None:
        """The record under which `version` served at some moment of [t0, t1], if any: it began
        (its swap started) before t1, and the next one's swap had not ended before t0."""
        last = bisect.bisect_right(self.starts, t1)
        for i in range(last - 1, -1, -1):
            r = self.records[i]
            nxt = self.records[i + 1] if i + 1 < len(self.records) else None
            if nxt is not None and nxt["t_end"] < t0:
                return None
            if r["version"] == version:
                return r
        return None


def audit(run_dir: str | Path, group_size: int, steps: int) -> dict:
    """The checks above over the run in `run_dir`: counts (each 0 when all holds), figures, and the
    problems found, each in a line."""
    run_dir = Path(run_dir)
    problems: list[str] = []
    trained_steps = {r["step"]: r["samples"] for r in read_records(run_dir / "trained.jsonl")}
    out = {**_samples(run_dir, trained_steps, group_size, problems),
           **_weights(run_dir, trained_steps, problems),
           **_job(run_dir, trained_steps, steps, problems)}
    out["problems"] = problems
    return out


def _samples(run_dir: Path, trained_steps: dict, group_size: int, problems: list[str]) -> dict:
    """Every prompt drawn: trained exactly once, dropped with a reason, or held in the last checkpoint."""
    ckpt = latest_checkpoint(run_dir)
    state = json.loads((ckpt / "rollout_state.json").read_text()) if ckpt is not None else None
    trained = collections.Counter()
    for step in sorted(trained_steps):
        for s in trained_steps[step]:
            trained[(s["group"], s["index"])] += 1
    dropped, held, drawn = {}, set(), set()
    if state is None:
        problems.append("no checkpoint: the data position and the dropped groups are unknown")
    else:
        for entry in state.get("dropped", []):
            gid, _, reason = entry.partition(":")
            dropped[gid] = reason
        held = {g["group_id"] for g in state["groups"]}
        data = state["data"]
        drawn = {f"g{i}" for i in range(data["epoch"] * data["size"] + data["cursor"])}
    trained_groups = {g for g, _ in trained}
    duplicated = sum(c - 1 for c in trained.values())
    lost = 0
    for gid in drawn:
        ways = (gid in trained_groups) + (gid in dropped) + (gid in held)
        if ways > 1:
            duplicated += group_size * (ways - 1)
            problems.append(f"{gid} is {'trained, ' * (gid in trained_groups)}{'dropped, ' * (gid in dropped)}"
                            f"{'held' * (gid in held)}: more than one")
        if gid in trained_groups:
            missing = [i for i in range(group_size) if (gid, i) not in trained]
            lost += len(missing)
            if missing:
                problems.append(f"{gid}: samples {missing} never trained")
        elif not ways:
            lost += group_size
            problems.append(f"{gid} was drawn but never trained, dropped or held")
    undrawn = sorted(g for g in trained_groups | set(dropped) | held if g not in drawn)
    if undrawn:
        problems.append(f"groups past the data position: {undrawn[:5]}")
    return {"samples_drawn": len(drawn) * group_size, "samples_trained": sum(trained.values()),
            "groups_dropped": dict(collections.Counter(dropped.values())), "groups_held": len(held),
            "samples_lost": lost, "samples_duplicated": duplicated, "samples_undrawn": len(undrawn) * group_size}


class Pushes:
    """The trainer's pushes (logs/pushes.jsonl), by update and by version."""

    def __init__(self, path: Path):
        self.records = read_records(path)
        self.by_update = {p["update_id"]: p for p in self.records}
        self.by_version = collections.defaultdict(list)
        for p in sorted(self.records, key=lambda p: p["t"]):
            self.by_version[p["version"]].append(p)

    def source(self, version: int, at: float, update_id: str | None) -> dict | None:
        """The trainer's push weights served as `version` came from: the same update, or (a copy
        a live server pushed to a new one) the trainer's last push of that version before `at`."""
        if update_id in self.by_update and self.by_update[update_id]["version"] == version:
            return self.by_update[update_id]
        earlier = [p for p in self.by_version.get(version, []) if p["t"] <= at]
        return earlier[-1] if earlier else None


def _weights(run_dir: Path, trained_steps: dict, problems: list[str]) -> dict:
    """Every version served came from a trainer's push with its digest; every trained token's
    version was its server's while its request ran."""
    pushes = Pushes(run_dir / "logs" / "pushes.jsonl")
    server_records = collections.defaultdict(list)
    for path in glob.glob(str(run_dir / "logs" / "commits-*.jsonl")):
        for r in read_records(path):
            server_records[r["server"]].append(r)
    timelines = {url: Timeline(rs) for url, rs in server_records.items()}
    uncommitted, mismatches, checked = set(), [0], set()

    def check(url: str, r: dict) -> None:
        if (url, r["t_start"]) in checked:
            return
        checked.add((url, r["t_start"]))
        push = pushes.source(r["version"], r["t_end"], r.get("update_id"))
        if push is None:
            uncommitted.add((url, r["version"], r["t_start"]))
            problems.append(f"{url} served version {r['version']} ({r['kind']} at {r['t_start']:.3f}), which the "
                            f"trainer never pushed")
        elif push["digest"] is not None and push["digest"] != r["digest"]:
            mismatches[0] += 1
            problems.append(f"{url} served version {r['version']} with digest {r['digest']}, the trainer's is "
                            f"{push['digest']} (update {push['update_id']})")

    commits = [(url, r) for url, rs in server_records.items() for r in rs if r["kind"] == "commit"]
    for url, r in commits:                  # a commit serves from then on
        check(url, r)
    off, tokens = 0, 0
    for step in sorted(trained_steps):
        for s in trained_steps[step]:
            versions = [v for v, n in s["versions"] for _ in range(n)]
            at = 0
            for url, t0, t1, n in s["segments"]:
                part = versions[at:at + n]
                for v in set(part):
                    tokens += part.count(v)
                    r = timelines[url].served_during(v, t0, t1) if url in timelines else None
                    if r is None:
                        off += part.count(v)
                        problems.append(f"sample {s['uid']} (step {step}): {part.count(v)} tokens of version {v} "
                                        f"from {url} in [{t0:.3f}, {t1:.3f}], when it did not serve that version")
                    elif r["kind"] == "load":        # served from the disk's weights: must be the trainer's
                        check(url, r)
                at += n
            if at != len(versions):
                off += abs(len(versions) - at)
                problems.append(f"sample {s['uid']} (step {step}): {len(versions)} generated tokens, its requests "
                                f"account for {at}")
    return {"pushes": len(pushes.records), "commits": len(commits), "servers": len(server_records),
            "tokens_checked": tokens, "served_uncommitted": len(uncommitted), "digest_mismatches": mismatches[0],
            "tokens_off_timeline": off}


def _job(run_dir: Path, trained_steps: dict, steps: int, problems: list[str]) -> dict:
    """The steps completed, each with its trained record, and the reward's first and last fifth."""
    metrics = {r["step"]: r for r in read_records(run_dir / "metrics.jsonl")}
    done = 0
    while done in metrics:
        done += 1
    rewards = [metrics[i]["reward/mean"] for i in range(done)]
    k = max(1, done // 5)
    if done < steps:
        problems.append(f"the job completed {done} of {steps} steps")
    missing = [i for i in range(done) if i not in trained_steps]
    if missing:
        problems.append(f"steps without a trained record: {missing[:5]}")
    return {"steps_completed": done, "steps_asked": steps,
            "reward_first_fifth": round(sum(rewards[:k]) / k, 4) if rewards else None,
            "reward_last_fifth": round(sum(rewards[-k:]) / k, 4) if rewards else None}
