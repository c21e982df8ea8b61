"""Long contexts under one KV budget: Riptide paged, Riptide contiguous (before) and vLLM's CPU build.

    python bench/long_context.py [--kv-gb 1] [--context 16384] [--num-requests 256] [--concurrency 64]
                                 [--scale 1.0] [--servers riptide,riptide_contiguous,vllm]

One tiny Llama (hidden 384, 4 layers, 6 heads, 2 KV heads: 4 KiB of fp32 keys and values a token,
random weights, saved with save_pretrained, positions to 16k+) served three ways with the same KV
memory (`--kv-gb`: Riptide's --kv-cache-gb, vLLM's VLLM_CPU_KVCACHE_SPACE) and context (16k), one
after the other, by one client (OpenAI /v1/completions, `concurrency` in flight, temperature 1,
ignore_eos, logprobs on). The workload: 256 requests, prompts of 64-512 random token ids, response
lengths from a long tail (lognormal, median ~1k tokens, the top few at 12k+; `--scale` shrinks every
length for a quick run). At 16k one contiguous slot is 64 MiB, so 1 GiB holds 16 of them; paged,
the same GiB holds 256k tokens.

Measured for each: generated tokens a second, p99 request latency, and the most sequences actually
running at once (the server's own gauge, polled every 0.25 s). Prints one JSON line:
`riptide_tok_s`, `riptide_contiguous_tok_s`, `vllm_tok_s`, `riptide_max_running`,
`riptide_contiguous_max_running`, `vllm_max_running`, the p99s, and the ratios
`paged_over_contiguous`, `paged_over_vllm`.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import re
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from _common import riptide_server  # noqa: E402
from vs_vllm import drive, ensure_vllm, vllm_server  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB = 384, 4, 6, 2, 8000
SERVERS = ("riptide", "riptide_contiguous", "vllm")
RUNNING = {"riptide": r"^riptide_num_running_reqs\s+([0-9.e+]+)", "vllm": r'^vllm:num_requests_running\{[^}]*\}\s+([0-9.e+]+)'}


def log(msg: str) -> None:
    print(f"[long_context {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def model_dir(scratch: Path, context: int) -> Path:
    base = scratch / f"long_context_llama_h{HIDDEN}_l{LAYERS}_kv{KV_HEADS}_p{context}"
    if not (base / "config.json").exists() or not any(base.glob("*.safetensors")):
        from inference_server.tiny_model import build_tiny_model
        build_tiny_model(base, hidden=HIDDEN, layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS, vocab=VOCAB,
                         max_positions=context + 64, arch="llama")
    return base


def workload(n: int, context: int, scale: float, seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompts of 64-512 tokens; response lengths lognormal (median 1000 * scale, sigma 0.9), the
    longest few set to 12k+ (scaled), each capped to fit the context with its prompt."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, VOCAB) for _ in range(rng.randint(64, 512))] for _ in range(n)]
    lengths = [int(1000 * math.exp(rng.gauss(0, 0.9))) for _ in range(n)]
    for i in rng.sample(range(n), max(1, n // 64)):                  # the tail: a few at 12k+
        lengths[i] = rng.randint(12000, 15500)
    max_new = [max(8, min(int(k * scale), context - len(p) - 8)) for p, k in zip(prompts, lengths)]
    return prompts, max_new


class RunningGauge:
    """The most sequences a server reported running, polled from its /metrics."""

    def __init__(self, url: str, kind: str):
        self.url, self.pattern, self.peak = url, re.compile(RUNNING[kind], re.M), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        import httpx
        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(0.25):
                with contextlib.suppress(httpx.HTTPError):
                    m = self.pattern.search(client.get(f"{self.url}/metrics").text)
                    if m:
                        self.peak = max(self.peak, int(float(m.group(1))))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def serve(name: str, model: Path, a, scratch: Path):
    if name == "vllm":
        with vllm_server(ensure_vllm(scratch), model, a.concurrency, scratch / "vllm_long_context.log",
                         extra=("--max-model-len", str(a.context)),
                         extra_env={"VLLM_CPU_KVCACHE_SPACE": f"{a.kv_gb:g}"}, log_stats=True) as (url, _):
            yield url, "tiny", "vllm"
        return
    layout = "contiguous" if name == "riptide_contiguous" else "paged"
    with riptide_server(model, "--max-running-requests", str(a.concurrency), "--context-length", str(a.context),
                        "--kv-cache-gb", f"{a.kv_gb:g}", "--kv-layout", layout,
                        log_path=str(scratch / f"{name}_long_context.log")) as (url, _):
        yield url, str(model), "riptide"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-gb", type=float, default=1.0)
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--scale", type=float, default=1.0, help="response lengths times this (a quick run: 0.1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--servers", default=",".join(SERVERS), type=lambda v: v.split(","))
    p.add_argument("--scratch", default=str(ROOT / ".cache" / "bench"))
    a = p.parse_args()
    if not set(a.servers) <= set(SERVERS):
        p.error(f"--servers: expected some of {SERVERS}, got {a.servers}")
    scratch = Path(a.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    model = model_dir(scratch, a.context)
    prompts, max_new = workload(a.num_requests, a.context, a.scale, a.seed)
    warm_prompts, warm_new = workload(16, 1024, 0.05, a.seed + 1)
    srt = sorted(max_new)
    log(f"{a.num_requests} requests: {sum(map(len, prompts))} prompt tokens, {sum(max_new)} to generate "
        f"(median {srt[len(srt) // 2]}, max {srt[-1]}), {a.concurrency} in flight, KV {a.kv_gb:g} GiB, context {a.context}")
    out: dict = {}
    for name in a.servers:
        with serve(name, model, a, scratch) as (url, served, kind):
            asyncio.run(drive(url, served, warm_prompts, warm_new, min(16, a.concurrency)))
            with RunningGauge(url, kind) as gauge:
                result = asyncio.run(drive(url, served, prompts, max_new, a.concurrency))
        out[f"{name}_tok_s"] = round(result["tok_s"], 1)
        out[f"{name}_p99_s"] = round(result["p99_s"], 2)
        out[f"{name}_wall_s"] = round(result["wall_s"], 1)
        out[f"{name}_max_running"] = gauge.peak
        log(f"{name}: {result['tok_s']:.0f} tok/s, p99 {result['p99_s']:.1f} s, at most {gauge.peak} running")
    if "riptide" in a.servers and "riptide_contiguous" in a.servers:
        out["paged_over_contiguous"] = round(out["riptide_tok_s"] / out["riptide_contiguous_tok_s"], 3)
    if "riptide" in a.servers and "vllm" in a.servers:
        out["paged_over_vllm"] = round(out["riptide_tok_s"] / out["vllm_tok_s"], 3)
    out.update({"kv_gb": a.kv_gb, "context": a.context, "num_requests": a.num_requests, "concurrency": a.concurrency,
                "scale": a.scale, "generated_tokens": sum(max_new)})
    sys.stderr.flush()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
