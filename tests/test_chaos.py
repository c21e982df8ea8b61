"""The chaos soak, short (bench/chaos.py runs the long one): a GRPO job under a seeded random
schedule of every fault kind, restarted with trainer.resume=auto whenever one ends it, then audited
from what it left. And the auditor itself: tampered records are caught (it is not vacuous), and the
problems the soak found stay fixed."""
from __future__ import annotations

import json
import os
import shutil
import signal

import pytest

from riptide_testing.audit import audit, read_records
from riptide_testing.chaos import KINDS, Soak, SoakConfig

TAIL = 40
GROUP = 8


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    """A job (2 servers) with a fault every ~4 s until 6 have landed (the six kinds come from a
    shuffled deck, and a kind with no target stays on top, so each kind lands once), then stopped and
    run TAIL steps past its last checkpoint without faults. Time-driven: however fast the job runs,
    every fault lands on it (a fixed 120-step job once finished before its last fault)."""
    root = tmp_path_factory.mktemp("chaos")
    cfg = SoakConfig(run_dir=str(root / "run"), steps=None, tail_steps=TAIL, seed=3, fault_window_s=600.0,
                     mean_gap_s=4.0, max_faults=6,
                     overrides=[f"model.path={root / 'model'}", "task.num_digits=1", "rollout.max_new_tokens=3",
                                f"rollout.group_size={GROUP}", "trainer.lr=0.005"])
    messages = []
    result = Soak(cfg, log=messages.append).run()
    return result, cfg, messages


def test_a_job_under_every_kind_of_fault_loses_nothing_and_serves_only_what_was_pushed(soak):
    result, cfg, messages = soak
    print(json.dumps(result), *messages, sep="\n")
    assert result["problems"] == []
    assert result["samples_lost"] == result["samples_duplicated"] == result["samples_undrawn"] == 0
    assert result["served_uncommitted"] == result["digest_mismatches"] == result["tokens_off_timeline"] == 0
    assert result["hangs"] == 0
    assert result["steps_completed"] == result["steps_asked"] >= TAIL
    assert result["tokens_checked"] > 0 and result["commits"] > 0
    assert set(result["faults_injected"]) == set(KINDS)
    assert result["lives"] > 1                                     # restarts happened, and were survived
    assert result["reward_last_fifth"] > result["reward_first_fifth"]


def steps(run) -> int:
    """The steps the soak's job was asked to end at (its last life's)."""
    return sum(1 for _ in open(run / "metrics.jsonl"))


def tampered(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("wandb", "hydra"))
    return copy


def rewrite(path, change):
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    change(lines)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_the_auditor_catches_a_sample_trained_twice_and_one_never_trained(soak, tmp_path):
    _, cfg, _ = soak
    run = tampered(cfg.run_dir, tmp_path)

    def twice(lines):
        lines[-1]["samples"].append(lines[0]["samples"][0])        # step 0's first sample again at the end
        lines[1]["samples"].pop()                                  # and one of step 1's never trained
    rewrite(run / "trained.jsonl", twice)
    report = audit(run, GROUP, steps(run))
    assert report["samples_duplicated"] == 1 and report["samples_lost"] == 1


def test_the_auditor_catches_weights_the_trainer_did_not_push(soak, tmp_path):
    _, cfg, _ = soak
    run = tampered(cfg.run_dir, tmp_path)
    # a server killed before its first push logged only its load: tamper with one that committed
    committed = [p for p in sorted((run / "logs").glob("commits-*.jsonl"))
                 if any(r["kind"] == "commit" for r in read_records(p))]

    def other_weights(lines):
        c = next(x for x in lines if x["kind"] == "commit")
        c["digest"] = "0" * 32                                     # a commit of weights the trainer never had
    rewrite(committed[0], other_weights)

    def unpushed(lines):
        lines[-1]["version"] = 10_000                             # the last push never happened
    rewrite(run / "logs" / "pushes.jsonl", unpushed)
    report = audit(run, GROUP, steps(run))
    assert report["digest_mismatches"] >= 1 and report["served_uncommitted"] >= 1


def test_the_auditor_catches_a_token_its_server_was_not_serving(soak, tmp_path):
    _, cfg, _ = soak
    run = tampered(cfg.run_dir, tmp_path)

    def relabel(lines):
        s = lines[-1]["samples"][0]
        s["versions"] = [[v + 1000, n] for v, n in s["versions"]]
    rewrite(run / "trained.jsonl", relabel)
    assert audit(run, GROUP, steps(run))["tokens_off_timeline"] > 0


def test_a_server_that_dies_while_the_job_starts_is_left_out_and_replaced(tmp_path, monkeypatch):
    """Found by the soak: a server killed while the fleet started failed the launch, and the job with
    it. Now the job starts with the servers that came up, and a replacement joins."""
    import time

    from inference_server.process import ServerProcess
    from trainer_bridge.backend import BackendConfig, RolloutBackend
    from trainer_bridge.config import ClusterConfig, ServerConfig, TaskConfig
    from trainer_bridge.job.run import ensure_model
    from trainer_bridge.train import compose_job
    from transformers import AutoModelForCausalLM

    job = compose_job([f"model.path={tmp_path / 'model'}", "task.num_digits=1", "rollout.max_new_tokens=3"])
    ensure_model(job)
    spawned = []
    real_spawn = ServerProcess.spawn

    def spawn_and_kill_the_second(self):
        out = real_spawn(self)
        spawned.append(self)
        if len(spawned) == 2:
            os.kill(self.proc.pid, signal.SIGKILL)
        return out
    monkeypatch.setattr(ServerProcess, "spawn", spawn_and_kill_the_second)
    cfg = BackendConfig(model_path=job.model.path, task=TaskConfig(name="copy", num_digits=1),
                        rollout=job.rollout, server=ServerConfig(num_servers=2, context_length=256),
                        cluster=ClusterConfig(replace_evicted=True), log_dir=str(tmp_path / "logs"))
    model = AutoModelForCausalLM.from_pretrained(job.model.path)
    backend = RolloutBackend(cfg)
    try:
        backend.start(model, version=0)
        assert len(backend.servers) == 1
        deadline = time.monotonic() + 120
        version = 0
        while len(backend.servers) < 2 and time.monotonic() < deadline:
            backend.next_batch()
            version += 1
            backend.push_weights(model, version)
        assert len(backend.servers) == 2, "no replacement joined"
        assert backend.stats.replacements == 1
    finally:
        backend.close()


def test_a_killed_rollout_process_is_named_when_the_trainer_next_calls_it(tmp_path):
    """Found by the soak: a SIGKILLed rollout process surfaced as a bare BrokenPipeError."""
    from rollout.service import LocalRollout
    host = LocalRollout()
    try:
        os.kill(host._proc.pid, signal.SIGKILL)
        host._proc.wait(30)
        host._started = True
        with pytest.raises(RuntimeError, match=r"rollout process died \(exit code -9\) during next_batch"):
            host.next_batch(timeout_s=10)
    finally:
        host.close()
