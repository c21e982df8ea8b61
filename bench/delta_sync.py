"""Delta sync against full pushes, on weights a real optimizer moved.

    python bench/delta_sync.py [--steps 10] [--lrs 1e-6,1e-5] [--hidden 512 --layers 8]
                               [--rate-mbit 100] [--capped-steps 5] [--no-capped]

A Qwen2 of ~26M parameters (hidden 512 x 8 layers, a character tokenizer) is built, saved with
save_pretrained and served by two Riptide servers holding bf16 weights (as real servers do). The
trainer loads the same checkpoint in fp32 (master weights, as mixed-precision training keeps them)
and trains it for real on the demo task (copy: prompt "copy:DIGITS=", answer DIGITS; the cross-entropy
of the answer tokens, AdamW, betas 0.9/0.999, weight decay 0.01, batch 16) for `--steps` steps at each
learning rate, from the same start. After every step the same weights are pushed twice, as one version:
with delta sync to server A (`WeightSync(delta=True)`: after the first push, only the bf16 elements
that changed) and in full to server B. Per step: `changed_fraction` (bf16 elements that changed),
`wire_fraction` (bytes sent to A over the model's bytes), `delta_push_s`, `full_push_s`. At the end
both servers' live digests must equal the trainer's weights in bf16 (`verified`).

Then the same on a capped link (`--rate-mbit` each way; --capped-steps steps at each learning rate):
the trainer and the servers each on a host of their own (network namespaces on a bridge,
tests/hosts.py, as root; skipped with the reason where namespaces are refused).

Keys: `wire_fraction_lr1e6`, `wire_fraction_lr1e5` (median over the steps of wire bytes / model bytes),
`delta_over_full_push_s` (median over every step of delta push s / full push s, loopback) and
`delta_over_full_push_s_capped`; goals: wire_fraction_lr1e6 <= 0.05, delta_over_full_push_s_capped
<= 0.3. The last line printed is one JSON object; logs go to stderr.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SERVER_ARGS = ["--dtype", "bfloat16", "--context-length", "256", "--cpu-threads", "1", "--no-cpu-split"]


def log(msg: str) -> None:
    print(f"[delta_sync {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def lr_key(lr: float) -> str:
    return f"lr{lr:.0e}".replace("e-0", "e").replace("e+0", "e").replace("-", "")


def batches(tokenizer, steps: int, size: int, seed: int):
    """The demo task as supervised batches: the answer tokens' labels, the prompt masked."""
    import torch

    from rollout.tasks import digit_items
    items = digit_items("copy", 8, steps * size, seed)
    for k in range(steps):
        rows = items[k * size:(k + 1) * size]
        ids, labels = [], []
        for it in rows:
            p = tokenizer(it["prompt"], add_special_tokens=False)["input_ids"]
            a = tokenizer(it["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids.append(p + a)
            labels.append([-100] * len(p) + a)
        n = max(len(x) for x in ids)
        pad = tokenizer.pad_token_id or 0
        yield (torch.tensor([x + [pad] * (n - len(x)) for x in ids]),
               torch.tensor([y + [-100] * (n - len(y)) for y in labels]))


def drive(a) -> dict:
    """Train and push, step by step: the delta sender to urls[0], the full one to urls[1]."""
    import httpx
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from weight_sync import live_digest, named_weights
    from weight_sync.sender import WeightSync
    logging.getLogger("weight_sync").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    key = os.environ.get("RIPTIDE_API_KEY") or None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    delta_url, full_url = a.urls.split(",")
    from fleet import wait_served
    wait_served([delta_url, full_url], 300)
    out: dict = {"per_lr": {}}
    version = int(httpx.get(f"{delta_url}/get_weight_version", headers=headers, timeout=30).json()["weight_version"])
    for lr in [float(x) for x in a.lrs.split(",")]:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        kw = dict(bucket_bytes=a.bucket_mb << 20, timeout_s=120, api_key=key, host=a.host)
        delta, full = WeightSync([delta_url], delta=True, **kw), WeightSync([full_url], **kw)
        steps = []
        try:
            version += 1                              # the start: whole to both (the delta sender's base)
            delta.push(model, version)
            full.push(model, version)
            out["model_bytes"] = sum(t.numel() * 2 for t in named_weights(model).values())
            for ids, labels in batches(tokenizer, a.steps, a.batch, seed=0):
                out_loss = model(input_ids=ids, labels=labels).loss
                out_loss.backward()
                loss = out_loss.item()
                opt.step()
                opt.zero_grad()
                version += 1
                d = delta.push(model, version)
                f = full.push(model, version)
                steps.append({"loss": round(loss, 4), "changed_fraction": round(d.changed_fraction, 5),
                              "wire_fraction": round(d.wire_fraction, 5), "delta_push_s": round(d.seconds, 4),
                              "full_push_s": round(f.seconds, 4), "delta_buckets": d.delta_buckets,
                              "buckets": d.buckets})
                log(f"lr {lr:g} step {len(steps)}: loss {loss:.3f}, changed {d.changed_fraction:.4f}, "
                    f"wire {d.wire_fraction:.4f}, delta {d.seconds:.3f} s, full {f.seconds:.3f} s")
        finally:
            delta.close()
            full.close()
        want = live_digest({n: t.detach().to(torch.bfloat16) for n, t in named_weights(model).items()})
        got = [httpx.get(f"{u}/weight_sync/digest", headers=headers, timeout=120).json()["digest"]
               for u in (delta_url, full_url)]
        out["per_lr"][lr_key(lr)] = {"lr": lr, "steps": steps, "verified": got == [want, want]}
    return out


def summary(run: dict) -> dict:
    med = statistics.median
    per = run["per_lr"]
    out = {f"wire_fraction_{k}": round(med([s["wire_fraction"] for s in v["steps"]]), 5) for k, v in per.items()}
    out.update({f"changed_fraction_{k}": round(med([s["changed_fraction"] for s in v["steps"]]), 5)
                for k, v in per.items()})
    ratios = [s["delta_push_s"] / s["full_push_s"] for v in per.values() for s in v["steps"]]
    out["delta_over_full_push_s"] = round(med(ratios), 4)
    out.update({f"delta_over_full_push_s_{k}": round(med([s["delta_push_s"] / s["full_push_s"] for s in v["steps"]]), 4)
                for k, v in per.items()})
    out["verified"] = all(v["verified"] for v in per.values())
    return out


def loopback(a, path: str) -> dict:
    from inference_server.process import ServerProcess
    logs = Path(tempfile.mkdtemp(prefix="riptide_delta_bench_"))
    servers = [ServerProcess(path, args=SERVER_ARGS, log_path=logs / f"server{i}.log") for i in range(2)]
    try:
        for s in servers:
            s.start(timeout=300)
        a.urls, a.host, a.model = ",".join(s.url for s in servers), None, path
        return drive(a)
    finally:
        for s in servers:
            s.stop()


def capped(a, path: str) -> dict | str:
    """The trainer on host 0, server A on host 1, server B on host 2, every link capped."""
    from tests.hosts import Hosts, namespaces_refused
    refused = namespaces_refused()
    if refused:
        return f"skipped: {refused}"
    token = secrets.token_urlsafe(24)
    logs = Path(tempfile.mkdtemp(prefix="riptide_delta_hosts_"))
    with Hosts(3, prefix="rd") as hosts:
        urls = []
        for i, h in enumerate(hosts.hosts[1:]):
            h.run([sys.executable, "-m", "inference_server", "--model-path", path, "--host", h.addr, "--port", "30000",
                   *SERVER_ARGS], env={"RIPTIDE_API_KEY": token}, log_path=str(logs / f"server{i}.log"))
            urls.append(f"http://{h.addr}:30000")
        for h in hosts:
            h.cap(a.rate_mbit)
        driver = [sys.executable, str(Path(__file__).resolve()), "--driver", "--model", path, "--urls", ",".join(urls),
                  "--host", hosts[0].addr, "--steps", str(a.capped_steps), "--lrs", a.lrs, "--batch", str(a.batch),
                  "--bucket-mb", str(a.bucket_mb)]
        log(f"servers on {[h.addr for h in hosts.hosts[1:]]}, links capped at {a.rate_mbit} Mbit/s")
        try:
            text = hosts[0].check_output(driver, timeout=3600, env={"RIPTIDE_API_KEY": token})
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"the capped-link driver failed: {e.stderr[-3000:]}") from None
    return json.loads(text.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lrs", default="1e-6,1e-5")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--bucket-mb", type=int, default=16)
    p.add_argument("--rate-mbit", type=float, default=100.0)
    p.add_argument("--capped-steps", type=int, default=5)
    p.add_argument("--no-capped", action="store_true")
    p.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--urls", help=argparse.SUPPRESS)
    p.add_argument("--host", help=argparse.SUPPRESS)
    a = p.parse_args()
    sys.path.append(str(ROOT / "bench"))     # last: bench/weight_sync.py must not hide the package
    if a.driver:
        print(json.dumps(drive(a)), flush=True)
        return
    from inference_server.tiny_model import build_tiny_model
    t0 = time.perf_counter()
    path = ROOT / ".cache" / f"bench-delta-h{a.hidden}-l{a.layers}"
    if not any(path.glob("*.safetensors")):
        build_tiny_model(path, hidden=a.hidden, layers=a.layers, heads=a.hidden // 64, kv_heads=2,
                         tokenizer="chars", max_positions=512)
    path = str(path)
    run = loopback(a, path)
    out = {**summary(run), "model_bytes_bf16": run["model_bytes"]}
    log(f"loopback: {out}")
    if not a.no_capped:
        cap = capped(a, path)
        if isinstance(cap, str):
            out["capped"] = cap
        else:
            s = summary(cap)
            out.update(delta_over_full_push_s_capped=s["delta_over_full_push_s"],
                       wire_fraction_capped={k: v for k, v in s.items() if k.startswith("wire_fraction_")},
                       verified_capped=s["verified"], rate_mbit=a.rate_mbit, capped_per_lr=cap["per_lr"])
    out["per_lr"] = run["per_lr"]
    out["bench_seconds"] = round(time.perf_counter() - t0, 1)
    keys = ["wire_fraction_lr1e6", "wire_fraction_lr1e5", "delta_over_full_push_s", "delta_over_full_push_s_capped"]
    print(json.dumps({**{k: out[k] for k in keys if k in out}, **{k: v for k, v in out.items() if k not in keys}}),
          flush=True)


if __name__ == "__main__":
    main()
