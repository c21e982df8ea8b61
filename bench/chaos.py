"""A chaos soak: a GRPO job under a seeded random schedule of faults, audited (issue #34).

    python bench/chaos.py --minutes 20 --seed 0

The job (task copy, the tiny model, 2 servers, async, `weight_sync.audit=true`) runs to its last
step while faults land on it: servers SIGKILLed or SIGSTOPped and woken up to 2.5x past the
timeouts, the trainer SIGKILLed right after a push began or SIGTERMed, the rollout process
SIGKILLed, a byte of a bucket write corrupted (riptide_testing/chaos.py has the fault model).
Whatever ends the job, it is started again with `trainer.resume=auto`. Afterwards the auditor
(riptide_testing/audit.py) reads what the job left: every prompt drawn trained exactly once,
dropped with a reason or held in the last checkpoint; every version a server served pushed by the
trainer with the trainer's digest; every trained token's version served by its server while its
request ran; the steps completed; the reward's first and last fifth.

`--minutes` is the window in which faults land (mean gap --mean-gap s). By default the soak is
time-driven: the job runs with no end while the window is open; when it closes, the trainer is
SIGTERMed (it checkpoints, as on any SIGTERM) and one last life, without faults, runs it from that
checkpoint to --tail-steps past it, so the job completes. `--steps N` fixes the job's length
instead (faults stop at the window's end or the job's, whichever comes first). The last line is the JSON: faults_injected (by kind), samples_lost, samples_duplicated,
served_uncommitted, digest_mismatches, tokens_off_timeline, steps_completed, reward_first_fifth,
reward_last_fifth, wall_s, seed, and `ok` (every loss and corruption count 0, the job complete,
the last fifth's reward above the first's).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from riptide_testing.chaos import KINDS, Soak, SoakConfig  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=20.0, help="faults land in this window")
    p.add_argument("--steps", type=int, default=None,
                   help="the job's steps (default: as many as --minutes allows, then --tail-steps)")
    p.add_argument("--tail-steps", type=int, default=50, help="time-driven: steps after the window closes")
    p.add_argument("--seed", type=int, default=0, help="the job's seed and the fault schedule's: a failure replays")
    p.add_argument("--mean-gap", type=float, default=20.0, help="mean seconds between faults")
    p.add_argument("--kinds", default=",".join(KINDS), help="fault kinds to draw from")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--run-dir", default=None, help="default: a new temporary directory (kept, named in the output)")
    p.add_argument("overrides", nargs="*", help="more riptide-train overrides, e.g. rollout.oversample=2")
    a = p.parse_args()
    run_dir = a.run_dir or tempfile.mkdtemp(prefix=f"riptide-chaos-s{a.seed}-")
    cfg = SoakConfig(run_dir=run_dir, steps=a.steps, tail_steps=a.tail_steps, seed=a.seed, fault_window_s=a.minutes * 60,
                     mean_gap_s=a.mean_gap, kinds=tuple(k for k in a.kinds.split(",") if k), servers=a.servers,
                     overrides=list(a.overrides))
    result = Soak(cfg, log=lambda m: print(m, file=sys.stderr, flush=True)).run()
    counts = ("samples_lost", "samples_duplicated", "samples_undrawn", "served_uncommitted", "digest_mismatches",
              "tokens_off_timeline", "hangs")
    result["ok"] = (all(result[k] == 0 for k in counts) and result["steps_completed"] == result["steps_asked"]
                    and (result["reward_last_fifth"] or 0) > (result["reward_first_fifth"] or 0))
    result["run_dir"] = run_dir
    for problem in result.pop("problems"):
        print("problem:", problem, file=sys.stderr)
    sys.stderr.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
