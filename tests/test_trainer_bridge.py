"""Riptide jobs end to end: Hydra launches, the attach API, learning, resume, clean exits."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAST = ["rollout.group_size=4", "rollout.batch_size=4", "server.context_length=64", "logger.progress=false"]


def train(tmp_path, *overrides, timeout=600, **kw):
    cmd = [sys.executable, "-m", "trainer_bridge.train", f"run_dir={tmp_path / 'run'}",
           f"model.path={tmp_path / 'model'}", *FAST, *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "WANDB_MODE": "offline"}, **kw)


def servers_of(path) -> list[int]:
    """PIDs of live processes whose command line names `path` (our servers name their model path)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "inference_server" in cmd and str(path) in cmd:
                pids.append(int(d.name))
    return pids


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("override, words", [
    ("trainer.lrr=0.1", ["trainer.lrr", "trainer.lr"]),
    ("rollout.oversampel=2", ["rollout.oversample"]),
    ("trainer.loss_agg=sum", ["trainer.loss_agg", "token-mean"]),
    ("trainer.lr_schedule=step", ["trainer.lr_schedule", "cosine"]),
    ("rollout.oversample=0.5", ["rollout.oversample", ">= 1.0"]),
    ("task=nosuchtask", ["nosuchtask"]),
])
def test_a_bad_config_is_refused_before_anything_starts(tmp_path, override, words):
    proc = train(tmp_path, override, timeout=120)
    assert proc.returncode != 0
    for w in words:
        assert w in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "model").exists(), "nothing was built or started"
    assert servers_of(tmp_path) == []


def test_lr_schedule_warms_up_then_decays_to_its_floor():
    from trainer_bridge.config import TrainerConfig
    from trainer_bridge.trainer import lr_at
    cfg = TrainerConfig(steps=11, lr=1.0, lr_schedule="cosine", lr_warmup_steps=2, min_lr_ratio=0.1)
    lrs = [lr_at(cfg, s) for s in range(11)]
    assert lrs[:3] == [0.5, 1.0, 1.0] and abs(lrs[-1] - 0.1) < 1e-9
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))        # no rise after warm-up
    assert abs(lr_at(cfg, 6) - 0.55) < 1e-9                       # cosine's midpoint
    linear = TrainerConfig(steps=11, lr=1.0, lr_schedule="linear", min_lr_ratio=0.0)
    assert [round(lr_at(linear, s), 6) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]
    assert lr_at(TrainerConfig(steps=11, lr=0.3), 7) == 0.3


def test_short_grpo_run_learns_and_cleans_up(tmp_path):
    proc = train(tmp_path, "trainer.steps=40", "task.num_digits=1", "rollout.max_new_tokens=2",
                 "rollout.group_size=8", "rollout.batch_size=8", "trainer.lr=0.005")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = last_json(proc.stdout)
    assert result["steps"] == 40
    assert result["last_reward"] > result["first_reward"] + 0.15, result
    run = tmp_path / "run"
    assert Path(result["plot"]).exists() and Path(result["wandb_dir"]).exists()
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(40))
    assert all(r["max_staleness"] <= 1 for r in lines)
    for key in ("reward/mean", "sync/gbps", "train/grad_norm", "train/logprob_mean_abs_diff",
                "rollout/tokens_per_s", "time/wait_for_data_s"):
        assert key in lines[-1]
    assert servers_of(tmp_path) == []


def test_resume_continues_steps_curve_and_data(tmp_path):
    first = train(tmp_path, "trainer.steps=4", "trainer.checkpoint_every=2")
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = tmp_path / "run" / "checkpoints"
    saved = json.loads((ckpt / "step-000004" / "rollout_state.json").read_text())
    second = train(tmp_path, "trainer.steps=7", "trainer.resume=latest", "trainer.lr=0.004",
                   "trainer.lr_schedule=cosine", "trainer.min_lr_ratio=0.1")
    assert second.returncode == 0, second.stderr[-3000:]
    result = last_json(second.stdout)
    assert result["first_step"] == 4 and result["steps"] == 7
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(7))
    # the schedule goes on from the checkpoint's step (not from 0): steps 4-6 of a 7-step cosine decay
    from trainer_bridge.config import TrainerConfig
    from trainer_bridge.trainer import lr_at
    cosine = TrainerConfig(steps=7, lr=0.004, lr_schedule="cosine", min_lr_ratio=0.1)
    assert [round(r["train/lr"], 9) for r in lines[4:]] == [round(lr_at(cosine, s), 9) for s in (4, 5, 6)]
    assert lines[-1]["train/lr"] < lines[4]["train/lr"] < 0.004
    later = json.loads((ckpt / "step-000007" / "rollout_state.json").read_text())
    assert later["trainer_version"] == 7 and saved["trainer_version"] == 4
    assert (later["data"]["epoch"], later["data"]["cursor"]) > (saved["data"]["epoch"], saved["data"]["cursor"])


@pytest.mark.parametrize("sig, num_servers", [(signal.SIGINT, 1), (signal.SIGTERM, 2)])
def test_no_server_survives_an_interrupted_launch(tmp_path, sig, num_servers):
    """Every server the launch started dies with it; N servers share the CPU's cores (on 2 cores: one
    decode thread each, no split steps, rather than 2 x 2 threads fighting over 2 cores)."""
    from inference_server.process import cpu_share_args
    cmd = [sys.executable, "-m", "trainer_bridge.train", f"run_dir={tmp_path / 'run'}",
           f"model.path={tmp_path / 'model'}", *FAST, "trainer.steps=500", f"server.num_servers={num_servers}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "WANDB_MODE": "offline"})
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "run" / "metrics.jsonl").exists() or \
                not (tmp_path / "run" / "metrics.jsonl").read_text():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.5)
        pids, share = servers_of(tmp_path), " ".join(cpu_share_args(num_servers))
        assert len(pids) == num_servers, "the launch started its servers"
        for pid in pids:
            argv = " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0"))
            assert share in argv, argv
        proc.send_signal(sig)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"the launch did not exit within 120 s of {sig.name}; its stderr ends:\n"
                        + proc.communicate()[1][-3000:])
    finally:
        if proc.poll() is None:
            proc.kill()
    for _ in range(50):
        if not servers_of(tmp_path):
            break
        time.sleep(0.2)
    assert servers_of(tmp_path) == []


def test_attach_example_runs(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "attach_own_trainer.py"), "3"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line.split(":")[0] for line in proc.stdout.strip().splitlines()] == ["step 0", "step 1", "step 2"]
    assert servers_of(tmp_path / ".cache") == []
