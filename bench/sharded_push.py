"""Weight sync from a sharded (FSDP2) trainer: the same model pushed into one server four ways.

    python bench/sharded_push.py [--hidden 768 --layers 8 --vocab 16000] [--bucket-mb 16] [--pushes 5]

 single:        one process, the model unsharded: WeightSync.push (what a 1-process trainer does).
 sharded:       2 ranks (torch.distributed, gloo, real processes), fully_shard on every decoder layer
                and the root; every rank calls push_sharded (mode direct): each rank writes its own
                shard's bytes into the server's slots with its own transfer engine, no gather.
 bucket_gather: the same ranks, push_sharded mode gather: the parameters gathered one bucket at a
                time while rank 0 streams them.
 gather_push:   the same ranks; every parameter gathered first (DTensor.full_tensor(), the whole model
                on every rank), then rank 0 pushes the gathered weights with WeightSync.push.

Push seconds: the median of --pushes pushes after one untimed warm-up, each a new version whose
every tensor differs (the server's digest is checked against the gathered weights after each mode).
For the ranks, a push's seconds are rank 0's, from a barrier before it to a barrier after it.
peak_extra_bytes_per_rank (the most of any rank) is what a push allocates beyond the model, from the
push's own accounting, not from the process's RSS: the staging buffers (single and gather modes:
rank 0's ring of num_slots + 1 buckets; sharded: one bucket on every rank) plus the gathered
parameters held at once (bucket_gather: about one bucket's, or a whole tensor when it is larger than
a bucket; gather_push: the whole model; sharded: none, as every parameter is sharded on dim 0).

The last line printed is one JSON object: sharded_push_s, gather_push_s, single_push_s,
bucket_gather_push_s, peak_extra_bytes_per_rank and peak_extra_buckets_per_rank (by mode),
model_bytes, bucket_bytes, trainer egress bytes per rank for the sharded push, pushes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))          # first: bench/weight_sync.py must not shadow the package

import torch  # noqa: E402

SERVER_ARGS = ["--context-length", "256", "--max-running-requests", "4"]


def log(msg: str) -> None:
    print(f"[sharded_push {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def nudge(model, version: int) -> None:
    """Every tensor a little different for each version (the same on every rank)."""
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(torch.rand((), generator=g).item() * 1e-3)


def rank_main(a) -> None:
    """One rank of the 2-rank modes (env as torchrun sets it); rank 0 writes its figures to a.out."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from weight_sync import live_digest, named_weights, sharded
    from weight_sync.sender import WeightSync

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    bucket = a.bucket_mb << 20
    sync = WeightSync([a.url], bucket_bytes=bucket, timeout_s=120) if rank == 0 else None
    state = sharded.RankState()                # this rank's engine and delta base, kept between pushes
    times, peaks = [], []
    for i in range(a.pushes + 1):
        version = a.first_version + i
        nudge(model, version)
        dist.barrier()
        t0 = time.perf_counter()
        if a.mode in ("sharded", "bucket_gather"):
            stats = sharded.push_sharded(model, version, sync, mode="direct" if a.mode == "sharded" else "gather",
                                         state=state)
            peak = stats.peak_gathered_bytes
        else:
            full = {n: t.full_tensor() for n, t in named_weights(model).items()}
            peak = sum(t.nbytes for t in full.values())
            if rank == 0:
                sync.push(full, version)
            del full
        dist.barrier()
        if i:                                  # the first is a warm-up
            times.append(time.perf_counter() - t0)
            peaks.append(peak)
    full = {n: t.full_tensor() for n, t in named_weights(model).items()}
    staging = bucket if a.mode == "sharded" else (sync.num_slots + 1) * bucket if sync is not None else 0
    out = {"rank": rank, "times": times, "peak_gathered": max(peaks), "digest": live_digest(full),
           "staging": staging, "egress": stats.egress_by_rank if a.mode == "sharded" and rank == 0 else None}
    Path(f"{a.out}.rank{rank}").write_text(json.dumps(out))
    if sync is not None:
        sync.close()
    dist.destroy_process_group()


def run_ranks(mode: str, model: Path, url: str, first_version: int, args, scratch: Path) -> list[dict]:
    from platforms.process import free_port
    out = scratch / f"{mode}.json"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, __file__, "--rank", "--mode", mode, "--model", str(model), "--url", url,
           "--first-version", str(first_version), "--out", str(out), "--pushes", str(args.pushes),
           "--bucket-mb", str(args.bucket_mb)]
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    try:
        for p in procs:
            if p.wait(1800) != 0:
                raise RuntimeError(f"{mode}: a rank exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--bucket-mb", type=int, default=16)
    p.add_argument("--pushes", type=int, default=5)
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--first-version", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank:
        return rank_main(a)

    logging.basicConfig(level=logging.WARNING)
    from transformers import AutoModelForCausalLM

    from _common import riptide_server
    from inference_server.tiny_model import build_tiny_model
    from weight_sync import named_weights
    from weight_sync.sender import WeightSync
    torch.set_num_threads(1)
    scratch = Path(tempfile.mkdtemp(prefix="riptide_sharded_push_"))
    model_dir = build_tiny_model(scratch / "model", hidden=a.hidden, layers=a.layers, heads=12, kv_heads=4,
                                 vocab=a.vocab, seed=0)
    bucket = a.bucket_mb << 20
    with riptide_server(model_dir, *SERVER_ARGS, log_path=str(scratch / "server.log")) as (url, _):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model_bytes = sum(t.nbytes for t in named_weights(model).values())
        log(f"model {model_bytes / 1e6:.0f} MB, bucket {a.bucket_mb} MB, {a.pushes} pushes a mode")
        sync = WeightSync([url], bucket_bytes=bucket, timeout_s=120)
        single = []
        for i in range(a.pushes + 1):
            nudge(model, 1 + i)
            stats = sync.push(model, 1 + i)
            if i:
                single.append(stats.seconds)
        staging = (sync.num_slots + 1) * bucket
        sync.close()
        del model
        log(f"single: {statistics.median(single):.3f}s")
        results, version = {}, a.pushes + 2
        for mode in ("sharded", "bucket_gather", "gather_push"):
            ranks = run_ranks(mode, model_dir, url, version, a, scratch)
            version += a.pushes + 1
            import httpx
            served = httpx.get(f"{url}/weight_sync/digest", timeout=120).json()["digest"]
            if served != ranks[0]["digest"]:
                raise SystemExit(f"{mode}: the server's weights differ from the gathered model's")
            results[mode] = ranks
            log(f"{mode}: {statistics.median(ranks[0]['times']):.3f}s")
    peak = {"single": staging,
            **{m: max(r["staging"] + r["peak_gathered"] for r in ranks) for m, ranks in results.items()}}
    sys.stderr.flush()
    print(json.dumps({
        "sharded_push_s": round(statistics.median(results["sharded"][0]["times"]), 4),
        "gather_push_s": round(statistics.median(results["gather_push"][0]["times"]), 4),
        "single_push_s": round(statistics.median(single), 4),
        "bucket_gather_push_s": round(statistics.median(results["bucket_gather"][0]["times"]), 4),
        "peak_extra_bytes_per_rank": peak,
        "peak_extra_buckets_per_rank": {m: (round(v / bucket, 2) if v is not None else None) for m, v in peak.items()},
        "model_bytes": model_bytes, "bucket_bytes": bucket, "pushes": a.pushes,
        "sharded_egress_bytes_by_rank": results["sharded"][0]["egress"],
        "push_s_all": {"single": [round(x, 4) for x in single],
                       **{m: [round(x, 4) for x in r[0]["times"]] for m, r in results.items()}},
    }), flush=True)


if __name__ == "__main__":
    main()
