"""Weight sync of a ~1 GB model: Riptide's push against a raw Mooncake write and a disk reload.

    python bench/weight_sync.py [--buckets 64,128,256] [--pushes 3] [--final-reps 5] [--quick]

Model: a random Qwen2 (hidden 1024, 17 layers, 16/4 heads, intermediate 2730, vocab 32000, untied,
float32) = 1.011 GB of parameters, built once into .cache/bench-1gb. The trainer side is the same
checkpoint loaded with `from_pretrained` (then copied into its own memory, as an optimizer's steps
leave a trainer's weights); before every update one element of every tensor is nudged,
so every version really differs (checked at the end: the servers' weight digests equal the trainer's).

 (a) riptide_gbps: `WeightSync([server]).push(weights, v)` to one idle server (shadow mode), bytes /
     PushStats.seconds (open + stream + prepare + commit, end to end). A sweep (untimed warm-up, then
     `--pushes` timed pushes per size) picks the bucket size with the best median. Two warm-ups on the
     first size: the server's start-up weights are a private mmap of the checkpoint, and the second
     push writes into them (copy-on-write faults on every page, once).
 (b) raw_mooncake_gbps: `transfer_sync_write` of the same bytes between two processes, no Riptide
     code, receiver buffer warm (bench/raw_mooncake.py `RawPair`): the better median of one write and
     of sequential bucket-sized writes. (a) and (b) are measured interleaved, `--final-reps` rounds at
     the chosen size, so drifting background load hits both alike; ratio_vs_raw_paired is the median
     of the per-round ratios.
 (c) disk_reload_gbps: `model.save_pretrained(tmp)` + `POST /update_weights_from_disk`, bytes /
     (save + reload + first-decode fault-in) seconds, median. The reload maps the file lazily, so its
     bytes are read during the first decode step after the swap; that step's extra time over a warm
     one-token generate is counted. The fresh file is read back from the page cache (no fsync).
 stall: 2 streaming clients keep generating (ignore_eos) while the server takes a push;
     stall_fraction = sum of server-reported stall seconds / push seconds (worst of the pushes).
     Extras: client inter-token gaps (max / median) in the 2 s before each push and during it.
 two_receivers_over_one: median seconds of a push to two servers / of a push to one, interleaved.

Logs go to stderr; the result is one JSON line on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# The repo root must come first: this file is itself named weight_sync.py and would shadow the package.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from raw_mooncake import RawPair  # noqa: E402

MODEL = dict(hidden=1024, layers=17, heads=16, kv_heads=4, intermediate=2730, vocab=32000, max_positions=2048,
             seed=0, arch="qwen2")
SERVER_ARGS = ["--context-length", "1024", "--max-running-requests", "4", "--weight-sync-mode", "shadow"]
MiB = 1 << 20


def log(msg: str) -> None:
    print(f"[weight_sync {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def model_dir(path: Path) -> Path:
    stamp = path / "bench_model.json"
    if not (stamp.exists() and json.loads(stamp.read_text()) == MODEL and any(path.glob("*.safetensors"))):
        from inference_server.tiny_model import build_tiny_model
        log(f"building the ~1 GB model into {path}")
        shutil.rmtree(path, ignore_errors=True)
        build_tiny_model(path, **MODEL)
        stamp.write_text(json.dumps(MODEL))
    return path


def perturb(params: dict[str, torch.Tensor], step: int) -> None:
    """Change one element of every tensor: each version differs everywhere, at no real cost."""
    with torch.no_grad():
        for p in params.values():
            flat = p.view(-1)
            flat[(step * 7919) % flat.numel()] += 1e-3


def process_cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (all its threads); this process when pid is None."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median(xs):
    return statistics.median(xs) if xs else None


# ---- streaming client -------------------------------------------------------------------------
class StreamClient:
    """Threads that keep one streaming /generate each in flight and record every event's arrival."""

    def __init__(self, url: str, streams: int, vocab: int, max_new_tokens: int = 256):
        self.url, self.vocab, self.max_new = url, vocab, max_new_tokens
        self.stop_evt = threading.Event()
        self.events: list[list[tuple[float, int, str]]] = []   # per request: (t, completion_tokens, version)
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(streams)]

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop_evt.set()
        for t in self._threads:
            t.join(30)

    def _run(self, seed: int) -> None:
        import httpx
        rng = random.Random(seed)
        with httpx.Client(base_url=self.url, timeout=httpx.Timeout(120)) as http:
            while not self.stop_evt.is_set():
                rec: list[tuple[float, int, str]] = []
                with self._lock:
                    self.events.append(rec)
                body = {"input_ids": [rng.randrange(10, self.vocab) for _ in range(32)], "stream": True,
                        "sampling_params": {"max_new_tokens": self.max_new, "temperature": 1.0, "ignore_eos": True}}
                try:
                    with http.stream("POST", "/generate", json=body) as r:
                        for line in r.iter_lines():
                            if self.stop_evt.is_set():
                                break
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            meta = json.loads(line[6:])["meta_info"]
                            rec.append((time.perf_counter(), meta["completion_tokens"], meta["weight_version"]))
                except Exception as e:  # noqa: BLE001 - reported, not fatal to the bench
                    self.errors.append(f"{type(e).__name__}: {e}")
                    time.sleep(0.2)

    def tokens(self) -> int:
        return sum(len(r) for r in self.events)

    def gaps(self, start: float, end: float, overlap: bool = True) -> list[float]:
        """Inter-token gaps (decode steps; prefill excluded) that overlap [start, end], or lie within it."""
        out = []
        for rec in list(self.events):
            for (t0, n0, _), (t1, _, _) in zip(rec, rec[1:]):
                inside = (t1 > start and t0 < end) if overlap else (t0 >= start and t1 <= end)
                if n0 >= 1 and inside:
                    out.append(t1 - t0)
        return out

    def version_flips_mid_request(self) -> int:
        return sum(1 for rec in list(self.events) if len({v for _, _, v in rec}) > 1)


def raw_d2h2d_gbps(params: dict[str, torch.Tensor]) -> float:
    """The floor of a push on one accelerator machine: every tensor's bytes to page-locked host
    memory and back into device memory, by DMA, queued at once, no hashing or protocol."""
    from platforms import platform_of
    device = next(iter(params.values())).device
    nbytes = sum(t.nbytes for t in params.values())
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    back = torch.empty(nbytes, dtype=torch.uint8, device=device)
    sync = platform_of(device).synchronize
    sync(device)
    t = time.perf_counter()
    at = 0
    for p in params.values():
        host[at:at + p.nbytes].copy_(p.reshape(-1).view(torch.uint8), non_blocking=True)
        at += p.nbytes
    sync(device)
    back.copy_(host, non_blocking=True)
    sync(device)
    return nbytes / (time.perf_counter() - t) / 1e9


# ---- the bench --------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=str(ROOT / ".cache" / "bench-1gb"))
    p.add_argument("--buckets", default="64,128,256", help="bucket sizes to try, MiB")
    p.add_argument("--pushes", type=int, default=3, help="timed pushes per bucket size in the sweep")
    p.add_argument("--final-reps", type=int, default=5, help="interleaved Riptide / raw rounds at the chosen size")
    p.add_argument("--disk-reps", type=int, default=3)
    p.add_argument("--load-pushes", type=int, default=2, help="pushes while clients generate")
    p.add_argument("--client-streams", type=int, default=2)
    p.add_argument("--two-reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one bucket size (128), fewer repetitions")
    p.add_argument("--device", default="cpu", help="cpu, cuda, npu: the trainer's weights and the servers live there "
                                                   "(an accelerator adds raw_d2h2d_gbps: the same bytes device -> "
                                                   "pinned host -> device, no Riptide code)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16: the trainer's and the servers' weights")
    a = p.parse_args()
    if a.quick:
        a.buckets, a.pushes, a.final_reps, a.disk_reps, a.load_pushes, a.two_reps = "128", 1, 2, 1, 1, 2
    buckets = [int(x) * MiB for x in a.buckets.split(",")]

    from transformers import AutoModelForCausalLM

    import httpx
    from inference_server.process import ServerProcess
    from weight_sync import live_digest, named_weights
    from weight_sync.sender import WeightSync

    t_start = time.perf_counter()
    path = model_dir(Path(a.model_dir))
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, a.dtype)).to(a.device)
    # from_pretrained maps the checkpoint file: the first read of every page faults. A trainer's
    # weights are its own memory once its optimizer has stepped (Adam writes every element), so the
    # bench's are too (a push reads them where they lie, without a copy: streaming.Streamer._direct_or).
    for t in trainer.parameters():
        t.data = t.data.clone()
    params = named_weights(trainer)
    nbytes = sum(t.nbytes for t in params.values())
    log(f"model: {nbytes / 1e9:.3f} GB in {len(params)} tensors")
    out: dict = {"model_bytes": nbytes, "device": a.device, "dtype": a.dtype}
    version = 0

    def next_version() -> int:
        nonlocal version
        version += 1
        perturb(params, version)
        return version

    logs = Path(tempfile.mkdtemp(prefix="riptide_ws_bench_"))
    servers = [ServerProcess(path, args=[*SERVER_ARGS, "--device", a.device, "--dtype", a.dtype],
                             log_path=logs / f"server{i}.log") for i in range(2)]
    syncs: list[WeightSync] = []
    ckpt_dir = Path(tempfile.mkdtemp(prefix="ckpt_", dir=path.parent))
    try:
        # Started one after the other from the main thread: ServerProcess sets PR_SET_PDEATHSIG, which
        # fires when the *thread* that forked the server exits, so a helper thread would kill it.
        for s in servers:
            s.start(timeout=300)
        for s in servers:   # a free port can be taken by another process between the pick and the bind
            info = httpx.get(f"{s.url}/get_model_info", timeout=10).json()
            if info.get("model_path") != str(path) or s.proc.poll() is not None:
                raise RuntimeError(f"{s.url} is not our server (exit code {s.proc.poll()}, serves "
                                   f"{info.get('model_path')}); logs in {logs}")
        A, B = servers
        log(f"servers up at {A.url}, {B.url} ({time.perf_counter() - t_start:.1f} s); logs in {logs}")

        # (a) Riptide's push to one idle server: a sweep over bucket sizes picks the size.
        sweep: dict[int, list] = {}
        for bb in buckets:
            sync = WeightSync([A.url], bucket_bytes=bb, num_slots=2, timeout_s=120)
            syncs.append(sync)
            # Untimed: the first push allocates the slots and the shadow set; the second writes into the
            # server's start-up weights, which from_pretrained left as a private mmap of the checkpoint
            # (copy-on-write faults on every page, once). Neither recurs in steady state.
            warm = [sync.push(params, next_version()) for _ in range(1 if sweep else 2)][-1]
            sweep[bb] = [sync.push(params, next_version()).gbps for _ in range(a.pushes)]
            log(f"bucket {bb // MiB} MiB: warm-up {warm.gbps:.3f} GB/s; timed " +
                ", ".join(f"{g:.3f}" for g in sweep[bb]) + " GB/s")
        best_bb = max(sweep, key=lambda bb: median(sweep[bb]))
        for s in syncs:
            if s.bucket_bytes != best_bb:
                s.close()
        sync1 = next(s for s in syncs if s.bucket_bytes == best_bb)
        syncs = [sync1]

        # (a) + (b), interleaved so that drifting background load hits both alike: a Riptide push at
        # the chosen size, a raw Mooncake write of the same bytes in one call, and one in bucket-sized calls.
        pair = RawPair(nbytes)
        runs, raw_one, raw_bucketed, cpu = [], [], [], []
        try:
            for _ in range(a.final_reps):
                v = next_version()
                c0, r0 = process_cpu_s(), process_cpu_s(A.proc.pid)
                runs.append(sync1.push(params, v))
                cpu.append((process_cpu_s() - c0, process_cpu_s(A.proc.pid) - r0))
                raw_one.append(pair.gbps())
                raw_bucketed.append(pair.gbps(best_bb))
        finally:
            pair.close()
        log(f"chosen {best_bb // MiB} MiB: riptide {['%.3f' % r.gbps for r in runs]}, raw one write "
            f"{['%.3f' % x for x in raw_one]}, raw {best_bb // MiB} MiB writes "
            f"{['%.3f' % x for x in raw_bucketed]} GB/s")
        by_time = sorted(runs, key=lambda r: r.seconds)
        mid = by_time[len(by_time) // 2]          # the median push, for its stages
        raw = max(median(raw_one), median(raw_bucketed))
        out.update(riptide_gbps=round(median([r.gbps for r in runs]), 3),
                   raw_mooncake_gbps=round(raw, 3),
                   riptide_best_gbps=round(max(r.gbps for r in runs), 3), bucket_mib=best_bb // MiB,
                   buckets=mid.buckets,
                   riptide_gbps_by_bucket={bb // MiB: round(median(g), 3) for bb, g in sweep.items()},
                   push_seconds=round(mid.seconds, 3),
                   stages_s={k: round(getattr(mid, k), 3) for k in
                             ("seconds", "open_s", "pack_s", "transfer_s", "apply_s", "commit_s")},
                   transfer_only_gbps=round(mid.bytes / mid.transfer_s / 1e9, 3) if mid.transfer_s else None,
                   cpu_s_per_push={"sender": round(median([c for c, _ in cpu]), 3),
                                   "receiver": round(median([r for _, r in cpu]), 3)},
                   retries=sum(r.retries for r in runs),
                   raw_mooncake_one_write_gbps=round(median(raw_one), 3),
                   raw_mooncake_bucketed_gbps=round(median(raw_bucketed), 3),
                   ratio_vs_raw_paired=round(median([r.gbps / max(o, b) for r, o, b in
                                                     zip(runs, raw_one, raw_bucketed)]), 3))

        if a.device != "cpu":
            d2h2d = [raw_d2h2d_gbps(params) for _ in range(max(3, a.final_reps))]
            out.update(raw_d2h2d_gbps=round(median(d2h2d), 3),
                       ratio_vs_d2h2d=round(out["riptide_gbps"] / median(d2h2d), 3))
            log(f"raw device -> host -> device copy: {['%.3f' % x for x in d2h2d]} GB/s")

        # (c) save_pretrained + /update_weights_from_disk, end to end. The reload maps the new file
        # lazily (safetensors), so its bytes are read (page faults) during the first decode step after
        # the swap: that extra time, over a warm one-token generate, is charged to the disk path too.
        disk = []
        with httpx.Client(base_url=A.url, timeout=600) as http:
            def one_token() -> float:
                t = time.perf_counter()
                http.post("/generate", json={"input_ids": list(range(10, 26)), "sampling_params": {
                    "max_new_tokens": 1, "temperature": 0.0}}).raise_for_status()
                return time.perf_counter() - t

            for _ in range(a.disk_reps):
                v = next_version()
                warm_gen = min(one_token() for _ in range(2))
                shutil.rmtree(ckpt_dir, ignore_errors=True)
                t0 = time.perf_counter()
                trainer.save_pretrained(ckpt_dir)
                t1 = time.perf_counter()
                r = http.post("/update_weights_from_disk", json={"model_path": str(ckpt_dir), "weight_version": v})
                t2 = time.perf_counter()
                r.raise_for_status()
                fault_in = max(0.0, one_token() - warm_gen)
                disk.append(dict(total=t2 - t0 + fault_in, save=t1 - t0, reload=t2 - t1, fault_in=fault_in,
                                 stall=r.json().get("stall_seconds", 0.0)))
                log(f"disk: save {t1 - t0:.2f} s + reload {t2 - t1:.2f} s + first-decode fault-in {fault_in:.2f} s"
                    f" -> {nbytes / disk[-1]['total'] / 1e9:.3f} GB/s")
        disk_total = median([d["total"] for d in disk])
        out.update(disk_reload_gbps=round(nbytes / disk_total / 1e9, 3),
                   disk_reload_no_fault_in_gbps=round(
                       nbytes / median([d["total"] - d["fault_in"] for d in disk]) / 1e9, 3),
                   disk_save_s=round(median([d["save"] for d in disk]), 3),
                   disk_reload_s=round(median([d["reload"] for d in disk]), 3),
                   disk_first_decode_fault_in_s=round(median([d["fault_in"] for d in disk]), 3),
                   disk_stall_s=round(median([d["stall"] for d in disk]), 4))
        # The server now serves an mmap of that file; the next two pushes (untimed) leave it behind.
        for _ in range(2):
            sync1.push(params, next_version())

        # Stall: pushes while clients stream tokens.
        loaded = []
        with StreamClient(A.url, a.client_streams, MODEL["vocab"]) as client:
            deadline = time.monotonic() + 60
            while client.tokens() < 4 * a.client_streams and time.monotonic() < deadline:
                time.sleep(0.1)
            for _ in range(a.load_pushes):
                v = next_version()
                base_start = time.perf_counter()
                time.sleep(2.0)
                t0 = time.perf_counter()
                st = sync1.push(params, v)
                t1 = time.perf_counter()
                time.sleep(0.5)
                before, during = client.gaps(base_start, t0, overlap=False), client.gaps(t0, t1)
                loaded.append((st, before, during))
                log(f"push under load: {st.gbps:.3f} GB/s, stall {sum(st.stall_s.values()) * 1e3:.2f} ms, "
                    f"gap max before {max(before, default=0) * 1e3:.0f} ms / during "
                    f"{max(during, default=0) * 1e3:.0f} ms ({len(during)} tokens)")
        if client.errors:
            log(f"client errors: {client.errors[:3]}")
        fractions = [sum(st.stall_s.values()) / st.seconds for st, _, _ in loaded]
        all_before = [x for _, b, _ in loaded for x in b]
        all_during = [x for _, _, d in loaded for x in d]
        out.update(stall_fraction=round(max(fractions), 6),
                   stall_s=round(max(sum(st.stall_s.values()) for st, _, _ in loaded), 5),
                   push_under_load_gbps=round(median([st.gbps for st, _, _ in loaded]), 3),
                   client_max_gap_before_s=round(max(all_before, default=0.0), 4),
                   client_max_gap_during_s=round(max(all_during, default=0.0), 4),
                   client_median_gap_before_s=round(median(all_before) or 0.0, 4),
                   client_median_gap_during_s=round(median(all_during) or 0.0, 4),
                   client_tokens_during_push=len(all_during),
                   client_requests_spanning_a_flip=client.version_flips_mid_request(),
                   client_errors=len(client.errors))

        # Two receivers against one, interleaved.
        sync2 = WeightSync([A.url, B.url], bucket_bytes=best_bb, num_slots=2, timeout_s=120)
        syncs.append(sync2)
        for _ in range(2):                   # warm-up: B's slots and shadow set, then its mmap'd start-up set
            sync2.push(params, next_version())
        one_s, two_s = [], []
        for _ in range(a.two_reps):
            one_s.append(sync1.push(params, next_version()).seconds)
            two_s.append(sync2.push(params, next_version()).seconds)
        log(f"one receiver {['%.3f' % x for x in one_s]} s, two {['%.3f' % x for x in two_s]} s")
        out.update(two_receivers_over_one=round(median(two_s) / median(one_s), 3),
                   two_receivers_gbps_per_receiver=round(nbytes / median(two_s) / 1e9, 3))

        # Both servers now serve the trainer's last version: same bytes everywhere?
        want = live_digest(named_weights(trainer))
        got = [httpx.get(f"{s.url}/weight_sync/digest", timeout=120).json() for s in servers]
        out["verified"] = all(g["digest"] == want and g["weight_version"] == version for g in got)
        if not out["verified"]:
            log(f"digest mismatch: trainer {want} v{version}, servers {got}")
    finally:
        for s in syncs:
            try:
                s.close()
            except Exception as e:  # noqa: BLE001
                log(f"closing a sender failed: {e}")
        for s in servers:
            s.stop()
        shutil.rmtree(ckpt_dir, ignore_errors=True)

    out["ratio_vs_raw"] = round(out["riptide_gbps"] / out["raw_mooncake_gbps"], 3)
    out["ratio_vs_disk"] = round(out["riptide_gbps"] / out["disk_reload_gbps"], 3)
    out["bench_seconds"] = round(time.perf_counter() - t_start, 1)
    keys = ["riptide_gbps", "raw_mooncake_gbps", "disk_reload_gbps", "ratio_vs_raw", "ratio_vs_disk",
            "stall_fraction", "two_receivers_over_one"]
    print(json.dumps({**{k: out[k] for k in keys}, **{k: v for k, v in out.items() if k not in keys}}))


if __name__ == "__main__":
    main()
