"""RL-shaped serving throughput: Riptide's server against transformers' baselines and a hand-written floor.

    python bench/serve_throughput.py [--num-requests 256] [--quick] [--kv-layout paged] [--profile-server /tmp/prof.txt]

One run, one tiny model (Qwen2, hidden 384, 4 layers, vocab 8000, random weights; built into a temp dir
if absent), one workload: N requests, prompt lengths uniform 16-512 (random ids in [10, vocab)),
max_new_tokens uniform 32-256, temperature 1, ignore_eos, logprobs on, fixed seed, so every method sees
the same prompts and lengths. Methods:

 (a) Riptide's server over HTTP (subprocess, --max-running-requests 64 --context-length 1024), an asyncio
     httpx client keeping exactly 64 requests in flight, one prompt per request with its own limit.
 (b) `model.generate` in static batches of 64 (left padding, do_sample, max_new_tokens = the batch's max,
     min_new_tokens = the same so no row stops early); only each request's own max_new_tokens count as
     useful tokens. No logprobs (output_scores off): a small advantage to HF.
 (c) transformers' continuous batching (ContinuousBatchingManager behind `generate_batch`), driven through
     `continuous_batching_context_manager` + `add_request` so each request keeps its own max_new_tokens;
     paged cache capped (num_blocks, max_batch_tokens), logprobs on; slow on CPU, so by default it runs
     only the first `--hf-cb-requests` requests (reported as `hf_cb_requests`); (a) then also runs that
     subset (`riptide_subset_tok_s`, `ratio_vs_hf_cb_same_subset`), since a drain-only batch of 64 has a
     tail that the full run's refills hide.
 (d) the floor: one hand-written batch-64 decode step over a contiguous KV cache at a mid-run length,
     with the model's own modules, SDPA (enable_gqa) and inverse-CDF sampling + logprobs; no prefill,
     no scheduling, no HTTP. floor_tok_s = 64 / step time (median). Extra: `floor_workload_tok_s` also
     charges this workload's prompt tokens at the speed of one plain batched forward (prefill floor).

Prints one JSON line; the ratios are riptide / baseline.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import riptide_server, tiny_model_dir  # noqa: E402

HIDDEN, LAYERS, VOCAB = 384, 4, 8000


def log(msg: str) -> None:
    print(f"[serve_throughput {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- workload ---------------------------------------------------------------------------------
def make_workload(n: int, vocab: int, seed: int, prompt_len=(16, 512), new_tokens=(32, 256)):
    rng = random.Random(seed)
    prompts, max_new = [], []
    for _ in range(n):
        prompts.append([rng.randrange(10, vocab) for _ in range(rng.randint(*prompt_len))])
        max_new.append(rng.randint(*new_tokens))
    return prompts, max_new


# ---- (a) Riptide's server over HTTP -----------------------------------------------------------
async def _drive(url: str, prompts, max_new, concurrency: int, subset: int) -> tuple[int, float, dict]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits) as client:
        async def one(prompt, k):
            async with sem:
                r = await client.post("/generate", json={
                    "input_ids": prompt,
                    "sampling_params": {"max_new_tokens": k, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                        "ignore_eos": True},
                    "return_logprob": True,
                })
                r.raise_for_status()
                meta = r.json()["meta_info"]
                n = meta["completion_tokens"]
                if n != k or len(meta["output_token_logprobs"]) != k:
                    raise RuntimeError(f"asked {k} tokens, got {n} ({meta['finish_reason']})")
                return n

        # warm-up (first-call allocations, thread pools), then a clean cache
        await asyncio.gather(*(one(p[:32], 4) for p in prompts[:4]))
        (await client.post("/flush_cache")).raise_for_status()
        before = await _metrics(client)
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p, k) for p, k in zip(prompts, max_new)))
        wall = time.perf_counter() - t0
        after = await _metrics(client)
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        steps = d.get("riptide_engine_steps_total", 0.0)
        busy = d.get("riptide_engine_busy_seconds_total", 0.0)
        engine = {"riptide_engine_steps": int(steps), "riptide_engine_busy_frac": busy / wall,
                  "riptide_mean_step_ms": 1e3 * busy / steps if steps else None,
                  "riptide_tokens_per_step": d.get("riptide_generation_tokens_total", 0.0) / steps if steps else None}
        if 0 < subset < len(prompts):   # the same requests (c) runs, for a like-for-like ratio
            (await client.post("/flush_cache")).raise_for_status()
            t0 = time.perf_counter()
            sub = await asyncio.gather(*(one(p, k) for p, k in zip(prompts[:subset], max_new[:subset])))
            engine["riptide_subset_tok_s"] = sum(sub) / (time.perf_counter() - t0)
        return sum(counts), wall, engine


async def _metrics(client) -> dict[str, float]:
    """Engine counters from /metrics (Prometheus text); {} if the endpoint is missing."""
    r = await client.get("/metrics")
    if r.status_code != 200:
        return {}
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name.split("{")[0]] = float(value)
            except ValueError:
                pass
    return out


def bench_riptide(model_dir, prompts, max_new, concurrency: int, profile: str | None, subset: int = 0,
                  threads: int = 2, device: str = "cpu", dtype: str = "float32", kv_layout: str = "auto") -> dict:
    # the same torch thread count as the baselines (the server's own default is cores - 1, which
    # leaves a core to a co-located rollout client; this client is light)
    extra = ("--max-running-requests", str(concurrency), "--context-length", "1024", "--device", device,
             "--dtype", dtype, "--kv-layout", kv_layout) + \
        (("--cpu-threads", str(threads)) if device == "cpu" else ())
    with riptide_server(model_dir, *extra) as (url, proc):
        log(f"(a) server up at {url} (pid {proc.pid}); {len(prompts)} requests, {concurrency} in flight")
        spy = None
        if profile:
            spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(proc.pid),
                                    "-o", profile, "--format", "raw", "-r", "50", "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            tokens, wall, engine = asyncio.run(_drive(url, prompts, max_new, concurrency, subset))
        finally:
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                try:
                    spy.wait(30)
                except subprocess.TimeoutExpired:
                    spy.kill()
    out = {"riptide_tok_s": tokens / wall, "riptide_wall_s": wall, "riptide_tokens": tokens} | engine
    if profile and Path(profile).exists():
        out["riptide_server_profile"] = summarize_profile(profile)
    return out


def summarize_profile(path: str) -> dict:
    """Share of py-spy samples (non-idle, all threads) per bucket of where the server spends its time."""
    run = "DecoderRunner.part (inference_server/model_runner.py"
    rules = [  # (bucket, substrings that must all be in the stack); the first match wins
        ("model.attention+kv_write", (run, "attend (")),
        ("model.lm_head+final_norm", (run, "_logits (")),
        ("model.qkv_proj+rope", (run, "_qkv (")),
        ("model.mlp", (run, "MLP.forward")),
        ("model.rmsnorm", (run, "RMSNorm.forward")),
        ("model.rope_tables", (run, "_rope (")),
        ("model.other (o_proj, embed, inputs)", (run,)),
        ("sampling", ("inference_server/sampler.py",)),
        ("split step: waiting for the other half", ("cpu_split.py", "Future.result")),
        ("split step: other", ("inference_server/cpu_split.py",)),
        ("postprocess (append, finish, notify)", ("_postprocess (inference_server/engine.py",)),
        ("slot sorting", ("_sort_slots (inference_server/engine.py",)),
        ("schedule", ("inference_server/scheduler.py",)),
        ("engine commands (add/finish requests)", ("_run_commands (inference_server/engine.py",)),
        ("engine other", ("inference_server/engine.py",)),
        ("http/asyncio/json (other threads)", ("",)),
    ]
    buckets, total = Counter(), 0
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        total += int(count)
        name = next(n for n, needles in rules if all(x in stack for x in needles))
        buckets[name] += int(count)
    leaves = Counter()
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if count.isdigit():
            leaves[stack.split(";")[-1]] += int(count)
    log("server profile, top leaf frames: " + "; ".join(
        f"{v / max(total, 1):.1%} {k}" for k, v in leaves.most_common(15)))
    return {k: round(v / max(total, 1), 3) for k, v in buckets.most_common()} | {"samples": total}


# ---- (b) HF generate in static batches --------------------------------------------------------
def bench_hf_generate(model, prompts, max_new, batch: int, pad_id: int) -> dict:
    from transformers import GenerationConfig

    def run(ps, m):
        width = max(len(p) for p in ps)
        ids = torch.full((len(ps), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(ps), width), dtype=torch.long)
        for i, p in enumerate(ps):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=None, top_p=1.0, max_new_tokens=m,
                               min_new_tokens=m, pad_token_id=pad_id, eos_token_id=model.config.eos_token_id)
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             generation_config=cfg)
        return out.shape[1] - width

    torch.manual_seed(0)
    run([p[:32] for p in prompts[:batch]], 4)            # warm-up
    useful = produced = 0
    t0 = time.perf_counter()
    for s in range(0, len(prompts), batch):
        ps, ks = prompts[s:s + batch], max_new[s:s + batch]
        got = run(ps, max(ks))
        useful += sum(min(k, got) for k in ks)
        produced += got * len(ps)
    wall = time.perf_counter() - t0
    return {"hf_generate_tok_s": useful / wall, "hf_generate_wall_s": wall,
            "hf_generate_padded_tok_s": produced / wall, "hf_generate_logprobs": False}


# ---- (c) HF continuous batching ---------------------------------------------------------------
def bench_hf_cb(model, prompts, max_new, concurrency: int) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 256
    per_req = -(-(max(len(p) for p in prompts) + max(max_new)) // page)
    cb_cfg = ContinuousBatchingConfig(
        page_size=page, num_blocks=concurrency * per_req + 8, max_batch_tokens=2048,
        max_requests_per_batch=concurrency, return_logprobs=True, seed=0, auto_switch_to_flash=False,
        allow_block_sharing=False)
    gen_cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=None, top_p=1.0, max_new_tokens=max(max_new),
                               eos_token_id=-1, pad_token_id=model.config.pad_token_id)
    logging_off()
    with torch.no_grad(), model.continuous_batching_context_manager(
            generation_config=gen_cfg, continuous_batching_config=cb_cfg, block=True, timeout=60,
            warmup=False) as mgr:
        def run(ps, ks):
            ids = [mgr.add_request(p, max_new_tokens=k, eos_token_id=-1) for p, k in zip(ps, ks)]
            done = {}
            while len(done) < len(ids):
                r = mgr.get_result(timeout=1)
                if r is not None and r.is_finished():
                    if r.error is not None:
                        raise RuntimeError(f"HF CB request {r.request_id} failed: {r.error}")
                    done[r.request_id] = r
                elif r is None and not mgr.is_running():
                    raise RuntimeError("HF CB generation thread died")
            return sum(len(done[i].generated_tokens) for i in ids)

        run([p[:32] for p in prompts[:4]], [4] * 4)         # warm-up
        t0 = time.perf_counter()
        tokens = run(prompts, max_new)
        wall = time.perf_counter() - t0
    if tokens != sum(max_new):
        raise RuntimeError(f"HF CB made {tokens} tokens, expected {sum(max_new)}")
    return {"hf_cb_tok_s": tokens / wall, "hf_cb_wall_s": wall, "hf_cb_requests": len(prompts),
            "hf_cb_config": {"attn": model.config._attn_implementation, "page_size": page,
                             "num_blocks": cb_cfg.num_blocks, "max_batch_tokens": cb_cfg.max_batch_tokens,
                             "max_requests_per_batch": concurrency, "per_request_max_new_tokens": True,
                             "return_logprobs": True}}


def logging_off() -> None:
    import logging
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)


# ---- (d) the floor ----------------------------------------------------------------------------
def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@torch.inference_mode()
def bench_floor(model, batch: int, length: int, steps: int, warmup: int = 5) -> dict:
    import torch.nn.functional as F

    cfg, dec = model.config, model.model
    layers = list(dec.layers)
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = layers[0].self_attn.head_dim
    scale = layers[0].self_attn.scaling
    p = next(model.parameters())
    kc = [torch.randn(batch, nkv, length + 1, hd, dtype=p.dtype, device=p.device) for _ in layers]
    vc = [torch.randn(batch, nkv, length + 1, hd, dtype=p.dtype, device=p.device) for _ in layers]
    gen = torch.Generator().manual_seed(0)
    pos = torch.full((batch,), length, device=p.device)
    tokens = torch.randint(10, cfg.vocab_size, (batch,), generator=gen).to(p.device)

    def step(tokens):
        x = dec.embed_tokens(tokens)                                     # [B, H]
        cos, sin = dec.rotary_emb(x, pos[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]                # [B, 1, hd]
        for i, layer in enumerate(layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(batch, nh, hd)
            k = a.k_proj(h).view(batch, nkv, hd)
            v = a.v_proj(h).view(batch, nkv, hd)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kc[i][:, :, length] = k
            vc[i][:, :, length] = v
            o = F.scaled_dot_product_attention(q[:, :, None, :], kc[i], vc[i], scale=scale, enable_gqa=True)
            x = x + a.o_proj(o.reshape(batch, nh * hd))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = model.lm_head(dec.norm(x)).float()
        logprobs = torch.log_softmax(logits, dim=-1)
        cdf = logprobs.exp().cumsum(dim=-1)
        u = torch.rand(batch, generator=gen).to(p.device)
        nxt = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=cfg.vocab_size - 1)
        chosen = logprobs.gather(1, nxt[:, None])[:, 0]
        chosen.tolist()                                                  # results leave the tensor world
        return torch.tensor(nxt.tolist(), device=p.device)

    for _ in range(warmup):
        tokens = step(tokens)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tokens = step(tokens)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {"floor_tok_s": batch / t, "floor_step_ms": t * 1e3, "floor_step_ms_min": min(times) * 1e3,
            "floor_kv_len": length, "floor_steps": steps}


@torch.inference_mode()
def bench_prefill_floor(model, prompt_len: int, batch: int = 8, reps: int = 5) -> dict:
    """Prompt tokens/s of one plain batched forward (equal lengths, no padding, logits of the last token only).

    Best of `reps`: a floor, and robust to other work on a shared machine."""
    ids = torch.randint(10, model.config.vocab_size, (batch, prompt_len),
                        generator=torch.Generator().manual_seed(1)).to(model.device)

    def run():
        h = model.model(input_ids=ids, use_cache=False).last_hidden_state
        model.lm_head(h[:, -1]).float().log_softmax(-1)

    run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return {"prefill_floor_tok_s": batch * prompt_len / min(times)}


# ---- main -------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight / static batch size")
    ap.add_argument("--hf-cb-requests", type=int, default=64, help="subset of requests for (c); 0 = all")
    ap.add_argument("--floor-steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-path", default=None, help="default: build the tiny model into a temp dir")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, cuda, npu: the server and the baselines run there")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 (the model's dtype everywhere)")
    ap.add_argument("--hidden", type=int, default=HIDDEN, help="model size (heads of 64); 1024 x 16 layers x "
                                                               "32000 vocab is ~0.5 GB in bf16")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--kv-layout", default="auto", choices=["auto", "paged", "contiguous"],
                    help="the server's KV cache layout (its --kv-layout)")
    ap.add_argument("--quick", action="store_true", help="~1 minute smoke run (64 requests, short lengths)")
    ap.add_argument("--skip", default="", help="comma list of methods to skip: riptide,hf_generate,hf_cb,floor")
    ap.add_argument("--profile-server", default=None, metavar="PATH",
                    help="py-spy the server during (a) (raw collapsed stacks to PATH; adds a summary)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))

    n = 64 if args.quick and args.num_requests == 256 else args.num_requests
    plen, nlen = ((16, 128), (16, 64)) if args.quick else ((16, 512), (32, 256))
    prompts, max_new = make_workload(n, args.vocab, args.seed, plen, nlen)
    model_dir = Path(args.model_path) if args.model_path else tiny_model_dir(args.hidden, args.layers, args.vocab)
    result: dict = {"num_requests": n, "prompt_tokens": sum(len(p) for p in prompts),
                    "concurrency": args.concurrency, "seed": args.seed, "prompt_len": list(plen),
                    "max_new_tokens": list(nlen), "useful_tokens": sum(max_new), "threads": args.threads,
                    "kv_layout": args.kv_layout, "quick": args.quick, "device": args.device, "dtype": args.dtype,
                    "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab}}
    t_start = time.perf_counter()

    if "riptide" not in skip:
        cb_subset = 0 if "hf_cb" in skip else args.hf_cb_requests
        result |= bench_riptide(model_dir, prompts, max_new, args.concurrency, args.profile_server, cb_subset,
                                args.threads, args.device, args.dtype, args.kv_layout)
        log(f"(a) riptide {result['riptide_tok_s']:.0f} tok/s in {result['riptide_wall_s']:.1f} s")

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype), attn_implementation="sdpa")
    model = model.to(args.device).eval().requires_grad_(False)

    if "floor" not in skip:
        length = int(statistics.mean(len(p) for p in prompts) + statistics.mean(max_new) / 2)
        result |= bench_floor(model, args.concurrency, length, 10 if args.quick else args.floor_steps)
        log(f"(d) floor {result['floor_tok_s']:.0f} tok/s ({result['floor_step_ms']:.1f} ms/step at len {length})")
        # The decode floor ignores prefill; the workload floor adds this workload's prompts at plain-forward speed.
        result |= bench_prefill_floor(model, int(statistics.mean(len(p) for p in prompts)))
        decode_s = sum(max_new) / result["floor_tok_s"]
        prefill_s = result["prompt_tokens"] / result["prefill_floor_tok_s"]
        result["floor_workload_tok_s"] = sum(max_new) / (decode_s + prefill_s)
    if "hf_generate" not in skip:
        result |= bench_hf_generate(model, prompts, max_new, args.concurrency, model.config.pad_token_id)
        log(f"(b) hf generate {result['hf_generate_tok_s']:.0f} tok/s in {result['hf_generate_wall_s']:.1f} s")
    if "hf_cb" not in skip:
        m = n if args.hf_cb_requests <= 0 else min(args.hf_cb_requests, n)
        result |= bench_hf_cb(model, prompts[:m], max_new[:m], args.concurrency)
        log(f"(c) hf continuous batching {result['hf_cb_tok_s']:.0f} tok/s on {m} requests")

    def ratio(a, b):
        return round(result[a] / result[b], 3) if a in result and b in result else None
    result["ratio_vs_hf_generate"] = ratio("riptide_tok_s", "hf_generate_tok_s")
    result["ratio_vs_hf_cb"] = ratio("riptide_tok_s", "hf_cb_tok_s")
    if "riptide_subset_tok_s" in result:   # both on the same first hf_cb_requests requests
        result["ratio_vs_hf_cb_same_subset"] = ratio("riptide_subset_tok_s", "hf_cb_tok_s")
    result["ratio_vs_floor"] = ratio("riptide_tok_s", "floor_tok_s")
    result["ratio_vs_workload_floor"] = ratio("riptide_tok_s", "floor_workload_tok_s")
    for k in ("riptide_tok_s", "hf_generate_tok_s", "hf_cb_tok_s", "floor_tok_s"):
        result.setdefault(k, None)
    result["total_wall_s"] = time.perf_counter() - t_start
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
