"""Long-tail rollouts: synchronous generate-then-train against Riptide's async manager, in one run.

    python bench/long_tail.py [--steps 40] [--train-share 0.3] [--oversample 4.0] [--max-staleness 4]
                              [--async-inflight 96] [--stale-policy keep] [--servers 2] [--order abba] [--quick]
                              [--speculative off|auto|on]

--servers (2) real servers (`python -m inference_server`, --max-running-requests 64 --context-length 1200,
plus `process.cpu_share_args`: on 2 cores, one decode thread each and no split steps) behind one Router,
the same servers for both modes, with a tiny random Qwen2 (hidden 256, 4 layers, 4/2 heads, vocab 4000;
built into a temp dir if absent). One server alone splits a big step over two threads, which hand the
GIL to each other at every op; two one-thread processes have a GIL each, and both modes gain from them
(see "Server layout" below), so the baseline is the faster layout too.

Workload: prompts "item N: ..." (a few tokens); every sample of every item has its own response length,
`max_new_tokens` ~ LogNormal(ln(--median-tokens), --sigma) clipped to [16, 1024], ignore_eos, drawn
deterministically from (seed, item, sample index) and stored in the item's metadata, so both modes see
the same lengths for the same items. Reward 0 for everyone, group filter `none` (rollout.filters.keep_all).

Trainer stand-in: `asyncio.sleep(a + b * tokens)` for a batch of `tokens` generated tokens, then a real
weight push (`WeightSync([server]).push(model, version)`, the trainer's copy loaded with from_pretrained,
one element of every tensor nudged per step) of version = previous + 1, numbered on across both modes.
a and b are calibrated so that training takes --train-share (0.3) of a synchronous step: on
--warmup-batches (4) untimed warm-up sync batches (other items) the server's synchronous generation
time per token is g = their generation time / their tokens, and for a batch of the workload's mean
size (N tokens, known from the drawn lengths) a = b * N = share / (1 - share) * g * N / 2: half of a
step is fixed, half grows with its tokens. 0.3 means rollout is 70% of a synchronous step, as RollPacker
(arXiv 2509.21009) measures for synchronous RL post-training; APRIL (arXiv 2509.18521) reports over 90%
(share < 0.1). --train-a/--train-b set them by hand instead.

What bounds the speedup, what a run keeps of it, and the measurements behind the defaults:
docs/long_tail.md.

 (a) sync: per step, batch_size groups x group_size samples, all requested at once through one
     Router (least in flight: spread evenly over the servers; same client as the manager), wait for
     all, train, push, repeat.
 (b) async: RolloutManager (max_inflight = --async-inflight, oversample, max_staleness, update_policy,
     abort_fraction), trainer_version =
     the server's version at its start; per step next_batch -> train -> push -> on_weights_updated, while
     the manager keeps generating.
 Order (--order abba): half of (a)'s steps, then (b), then the other half of (a) on the next items, so
 that a drift in this VM's speed over the run (it swings by 10-25% between minutes) weighs on both modes
 alike; --order ab runs all of (a) first.
Metrics: samples/s = trained samples / wall (first request to last push; the two sync halves summed);
busy ratio = delta of the servers' stats.busy_seconds / wall / servers; max staleness of any trained sample at consumption
(`s.staleness(trainer_version)`); samples lost = started, and neither trained, nor pending after stop(),
nor in a group the manager dropped and counted (`on_drop`), so it should be 0; samples_dropped_stale =
samples of groups dropped for breaking the staleness bound (their tokens are the wasted ones);
tokens wasted fraction = manager tokens_wasted / tokens_generated; tokens_wasted_fraction_server (extra) =
1 - (trained + pending samples' tokens) / tokens the server generated in (b), independent of the manager's
counters (they miss the tokens of groups reset by stale_policy=regenerate).

Logs go to stderr; the result is one JSON line on stdout.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = dict(hidden=256, layers=4, heads=4, kv_heads=2, vocab=4000, max_positions=2048, seed=0)
MIN_TOKENS, MAX_TOKENS = 16, 1024


def log(msg: str) -> None:
    print(f"[long_tail {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def model_dir(hidden: int | None = None, layers: int | None = None) -> Path:
    if hidden:
        MODEL.update(hidden=hidden, heads=max(1, hidden // 64), kv_heads=max(1, hidden // 128))
    if layers:
        MODEL.update(layers=layers)
    tag = "_".join(f"{k}{v}" for k, v in MODEL.items())
    path = Path(tempfile.gettempdir()) / f"riptide_bench_long_tail_{tag}"
    if not (path / "config.json").exists() or not any(path.glob("*.safetensors")):
        from inference_server.tiny_model import build_tiny_model
        log(f"building the tiny model into {path}")
        build_tiny_model(path, **MODEL)
    return path


# ---- workload ---------------------------------------------------------------------------------
def draw_length(seed: int, item: int, index: int, median: float, sigma: float) -> int:
    x = random.Random(f"long_tail-{seed}-{item}-{index}").lognormvariate(math.log(median), sigma)
    return int(min(MAX_TOKENS, max(MIN_TOKENS, round(x))))


def make_items(n: int, group_size: int, seed: int, median: float, sigma: float, offset: int = 0) -> list[dict]:
    words = "the sum of digits in reverse order is a number we can write down".split()
    items = []
    for i in range(offset, offset + n):
        prompt = f"item {i}: " + " ".join(words[(i * k) % len(words)] for k in range(1, 6))
        items.append({"prompt": prompt, "answer": 0,
                      "lengths": [draw_length(seed, i, j, median, sigma) for j in range(group_size)]})
    return items


async def long_tail_rollout(sample, ctx):
    """Generates exactly the sample's drawn length (ignore_eos); resumes within that budget."""
    left = sample.metadata["lengths"][sample.index] - sample.num_generated
    if left > 0:
        await ctx.generate(sample, max_new_tokens=left)
    else:
        from rollout.types import SampleStatus
        sample.status = SampleStatus.TRUNCATED
    return sample


async def zero_reward(sample) -> float:
    return 0.0


# ---- trainer side -----------------------------------------------------------------------------
class Trainer:
    """Sleeps like a train step, then pushes real weights; the version numbering runs across modes."""

    def __init__(self, path: Path, urls: list[str], version: int, a: float, b: float, bucket_bytes: int):
        import torch
        from transformers import AutoModelForCausalLM

        from weight_sync.sender import WeightSync
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.sync = WeightSync(urls, bucket_bytes=bucket_bytes)
        self.version, self.a, self.b = version, a, b
        self.train_s = self.push_s = 0.0
        self.push_times: list[float] = []

    async def step(self, tokens: int) -> int:
        t = time.monotonic()
        await asyncio.sleep(self.a + self.b * tokens)
        self.train_s += time.monotonic() - t
        t = time.monotonic()
        with self.torch.no_grad():
            for p in self.model.parameters():
                p.view(-1)[0] += 1e-3
        self.version += 1
        await asyncio.to_thread(self.sync.push, self.model, self.version)
        dt = time.monotonic() - t
        self.push_s += dt
        self.push_times.append(dt)
        return self.version

    def reset_counters(self) -> None:
        self.train_s = self.push_s = 0.0
        self.push_times = []

    def close(self) -> None:
        self.sync.close()


def make_router(urls: list[str]):
    from rollout.client import ServerClient
    from rollout.router import Router
    return Router([ServerClient(u, timeout_s=600) for u in urls])


async def server_stats(router) -> dict:
    """The servers' counters, summed; the version is the lowest any server holds."""
    infos = await asyncio.gather(*(c.get("/get_server_info") for c in router.clients))
    total: dict = {}
    for info in infos:
        for k, v in info["stats"].items():
            if isinstance(v, (int, float)):
                total[k] = total.get(k, 0) + v
    return {**total, "weight_version": min(int(info["weight_version"]) for info in infos)}


# ---- (a) synchronous ----------------------------------------------------------------------------
async def sync_batch(router, data, tokenizer, cfg, t_start: float | None = None):
    """One batch: every sample requested at once; returns samples, per-sample completion times, tokens."""
    from rollout.types import Finish, Sample, SampleStatus
    t0 = time.monotonic() if t_start is None else t_start
    samples = []
    for _ in range(cfg.batch_size):
        item = data.next()
        ids = tokenizer(item.prompt, add_special_tokens=False).input_ids
        samples += [Sample(f"s{item.index}", j, list(ids), item.prompt, 0, metadata=dict(item.metadata))
                    for j in range(cfg.group_size)]
    done: list[float] = []

    async def one(s):
        params = {**cfg.sampling_params(), "max_new_tokens": s.metadata["lengths"][s.index]}
        client = router.pick()           # least in flight: the batch spreads evenly over the servers
        gen = await router.call(client, client.generate(s.input_ids, params, f"sync-{s.uid}"))
        s.append_generated(gen.output_ids, gen.logprobs, gen.versions)
        s.status = SampleStatus.TRUNCATED if gen.finish is Finish.LENGTH else SampleStatus.COMPLETED
        done.append(time.monotonic() - t0)
    await asyncio.gather(*(one(s) for s in samples))
    return samples, done, sum(s.num_generated for s in samples)


async def run_sync(urls, tokenizer, data, cfg, trainer, steps, first_step: int = 0):
    router = make_router(urls)
    trainer.reset_counters()
    s0 = await server_stats(router)
    t0 = time.monotonic()
    trained, max_stale, tokens, gen_s, per_step = 0, 0, 0, 0.0, []
    try:
        for step in range(steps):
            tb = time.monotonic()
            samples, done, tok = await sync_batch(router, data, tokenizer, cfg)
            g = time.monotonic() - tb
            gen_s += g
            max_stale = max(max_stale, max(s.staleness(trainer.version) for s in samples))
            trained += len(samples)
            tokens += tok
            await trainer.step(tok)
            per_step.append({"gen_s": round(g, 2), "median_done_s": round(statistics.median(done), 2),
                             "tokens": tok, "max_len": max(len(s.response_ids) for s in samples)})
            log(f"sync step {first_step + step}: gen {g:.2f}s (median sample done {statistics.median(done):.2f}s), "
                f"{tok} tokens, longest {per_step[-1]['max_len']}, trainer at v{trainer.version}")
        wall = time.monotonic() - t0
        s1 = await server_stats(router)
    finally:
        await router.close()
    return {"wall_s": wall, "samples": trained, "tokens": tokens, "staleness_max": max_stale,
            "busy_s": s1["busy_seconds"] - s0["busy_seconds"], "gen_s": gen_s, "train_s": trainer.train_s,
            "server_steps": s1["steps"] - s0["steps"], "server_tokens": s1["generation_tokens"] - s0["generation_tokens"],
            "push_s": trainer.push_s, "per_step": per_step,
            "mean_len": tokens / trained, "server_version_end": s1["weight_version"]}


def merge_runs(parts: list[dict]) -> dict:
    """The two halves of an ABBA sync run as one."""
    out = dict(parts[-1])
    for k in ("wall_s", "samples", "tokens", "busy_s", "gen_s", "train_s", "server_steps", "server_tokens", "push_s"):
        out[k] = sum(p[k] for p in parts)
    out["staleness_max"] = max(p["staleness_max"] for p in parts)
    out["per_step"] = [s for p in parts for s in p["per_step"]]
    out["mean_len"] = out["tokens"] / out["samples"]
    return out


# ---- (b) asynchronous ---------------------------------------------------------------------------
async def run_async(urls, tokenizer, items, cfg, trainer, steps, align_capacity: bool):
    from rollout.data import PromptSource
    from rollout.filters import keep_all
    from rollout.manager import RolloutManager

    started: set[str] = set()

    async def tracked(sample, ctx):
        started.add(sample.uid)
        return await long_tail_rollout(sample, ctx)

    dropped: dict[str, str] = {}                 # sample uid -> why its group was dropped (counted, not lost)

    def on_drop(group, reason):
        dropped.update((s.uid, reason) for s in group.samples)

    router = make_router(urls)
    m = RolloutManager(cfg, router, PromptSource(items, seed=0, shuffle=False), tokenizer, zero_reward,
                       rollout_fn=tracked, group_filter=keep_all, on_drop=on_drop)
    s0 = await server_stats(router)
    m.trainer_version = s0["weight_version"]
    if align_capacity:
        # The manager's start bound (_may_start) counts versions from 0; keep it meaningful when the
        # trainer starts at version v0 > 0 (see the report: capacity uses absolute trainer_version).
        m.consumed_groups = m.trainer_version * cfg.batch_size
    consumed0 = m.consumed_groups
    trainer.version = m.trainer_version
    trainer.reset_counters()
    trained_uids: set[str] = set()
    trained, max_stale, tokens, wait_s, hist = 0, 0, 0, 0.0, {}
    inflight_samples, last_metrics = [], {}
    t0 = time.monotonic()
    await m.start()
    try:
        for step in range(steps):
            groups, metrics = await m.next_batch()
            last_metrics = metrics
            wait_s += metrics["wait_s"]
            samples = [s for g in groups for s in g.samples]
            st = [s.staleness(m.trainer_version) for s in samples]
            for v in st:
                hist[v] = hist.get(v, 0) + 1
            max_stale = max(max_stale, max(st))
            trained += len(samples)
            trained_uids.update(s.uid for s in samples)
            tok = sum(s.num_generated for s in samples)
            tokens += tok
            inflight_samples.append(metrics["inflight"])
            version = await trainer.step(tok)
            n_inflight = len(m.inflight)
            await m.on_weights_updated(version)
            log(f"async step {step}: waited {metrics['wait_s']:.2f}s, {tok} tokens, staleness {sorted(set(st))}, "
                f"inflight {metrics['inflight']}, running {metrics['groups_running']}, "
                f"ready {metrics['groups_ready']}, "
                f"drops {metrics['drops']}, trainer at v{version}, inflight at update {n_inflight}")
        wall = time.monotonic() - t0
        s1 = await server_stats(router)
    finally:
        await m.stop()
        s2 = await server_stats(router)
        await router.close()
    pending_samples = [s for g in [*m.ready, *m.resume, *m.running.values()] for s in g.samples]
    pending = {s.uid for s in pending_samples}
    # independent of the manager's counters: tokens the server generated in this phase that are neither
    # in a trained sample nor kept by a pending one
    server_gen = s2["generation_tokens"] - s0["generation_tokens"]
    kept = tokens + sum(s.num_generated for s in pending_samples)
    # lost: started, and neither trained, nor still held by the manager, nor dropped and counted
    lost = started - trained_uids - pending - set(dropped)
    dropped_started = {u for u in dropped if u in started}
    mt = m.metrics
    return {"wall_s": wall, "samples": trained, "tokens": tokens, "staleness_max": max_stale,
            "staleness_hist": dict(sorted(hist.items())),
            "busy_s": s1["busy_seconds"] - s0["busy_seconds"], "trainer_wait_s": wait_s,
            "server_steps": s1["steps"] - s0["steps"],
            "server_aborted": s1["aborted_requests"] - s0["aborted_requests"],
            "server_tokens": s1["generation_tokens"] - s0["generation_tokens"],
            "server_prompt_tokens": s1["prompt_tokens"] - s0["prompt_tokens"],
            "train_s": trainer.train_s, "push_s": trainer.push_s, "samples_lost": len(lost),
            "samples_dropped": len(dropped_started),
            "samples_started": len(started), "samples_pending": len(pending & started),
            "tokens_generated": mt.tokens_generated, "tokens_wasted": mt.tokens_wasted,
            "tokens_aborted": mt.tokens_aborted, "server_gen_total": server_gen, "tokens_kept": kept,
            "tokens_resumed": mt.tokens_resumed,
            "drops": dict(mt.drops), "stale_dropped": mt.stale_dropped,
            "mean_len": tokens / max(trained, 1), "consumed_groups": m.consumed_groups - consumed0,
            "mean_inflight_at_batch": statistics.mean(inflight_samples) if inflight_samples else 0,
            "server_version_end": s1["weight_version"], "drops_last": last_metrics.get("drops", {}),
            "lengths": mt.lengths.snapshot(), "tokens_masked_old": mt.tokens_masked_old,
            "waits_for_old": mt.waits_for_old, "wait_for_old_s": mt.wait_for_old_s}


# ---- main ---------------------------------------------------------------------------------------
async def bench(args, urls, path) -> dict:
    from transformers import AutoTokenizer

    from rollout.config import RolloutConfig
    from rollout.data import PromptSource

    tokenizer = AutoTokenizer.from_pretrained(path)
    common = dict(group_size=args.group_size, batch_size=args.batch_size, max_inflight=args.max_running,
                  max_new_tokens=MAX_TOKENS, ignore_eos=True, temperature=1.0, seed=args.seed)
    sync_cfg = RolloutConfig(**common, oversample=1.0, max_staleness=0, update_policy="continue").validate()
    async_cfg = RolloutConfig(**{**common, "max_inflight": args.async_inflight or args.max_running},
                              oversample=args.oversample, max_staleness=args.max_staleness,
                              update_policy=args.update_policy, abort_fraction=args.abort_fraction,
                              stale_policy=args.stale_policy, max_token_age=args.max_token_age).validate()
    n_items = (args.steps * 4 + 8) * args.batch_size
    items = make_items(n_items, args.group_size, args.seed, args.median_tokens, args.sigma)
    lens = [n for it in items for n in it["lengths"]]
    log(f"lengths over {len(lens)} samples: median {statistics.median(lens)}, mean {statistics.mean(lens):.0f}, "
        f"p90 {sorted(lens)[int(0.9 * len(lens))]}, max {max(lens)}, at cap {sum(n == MAX_TOKENS for n in lens)}")

    # warm-up + calibration: --warmup-batches untimed sync batches of other items; their generation time
    # per token, pooled (one batch's time hangs on its longest sample)
    router = make_router(urls)
    warm_items = make_items(args.batch_size * args.warmup_batches, args.group_size, args.seed, args.median_tokens,
                            args.sigma, offset=10_000_000)
    warm_data = PromptSource(warm_items, shuffle=False)
    batch_times, token_counts = [], []
    for _ in range(args.warmup_batches):
        samples, done, n = await sync_batch(router, warm_data, tokenizer, sync_cfg)
        batch_times.append(max(done))
        token_counts.append(n)
    v0 = (await server_stats(router))["weight_version"]
    await router.close()
    gen_s_per_token = sum(batch_times) / max(sum(token_counts), 1)
    mean_batch_tokens = statistics.mean(sum(it["lengths"]) for it in items) * args.batch_size
    if args.train_a is None or args.train_b is None:
        t_step = args.train_share / (1 - args.train_share) * gen_s_per_token * mean_batch_tokens
        a = t_step / 2
        b = a / mean_batch_tokens
    else:
        a, b = args.train_a, args.train_b
    log(f"warm-up sync batches: {', '.join(f'{t:.2f}' for t in batch_times)}s for {', '.join(map(str, token_counts))} "
        f"tokens ({1000 * gen_s_per_token:.3f} ms a token); mean batch {mean_batch_tokens:.0f} tokens; "
        f"train step = {a:.3f} + {b:.2e} * tokens s; server at version {v0}")

    trainer = Trainer(path, urls, v0, a, b, args.bucket_bytes)
    try:
        await trainer.step(0)            # untimed: allocates the push buffers (first push is slower)
        # ABBA: half the sync steps before the async run and half after, on the next items, so a
        # drift in this machine's speed over the run weighs on both modes alike
        sync_data = PromptSource(items, seed=0, shuffle=False)
        first = args.steps // 2 if args.order == "abba" else args.steps
        parts = [await run_sync(urls, tokenizer, sync_data, sync_cfg, trainer, first)]
        asyn = await run_async(urls, tokenizer, items, async_cfg, trainer, args.steps, args.align_capacity)
        if args.steps > first:
            parts.append(await run_sync(urls, tokenizer, sync_data, sync_cfg, trainer, args.steps - first, first))
        sync = merge_runs(parts)
    finally:
        trainer.close()
    sync_sps, async_sps = sync["samples"] / sync["wall_s"], asyn["samples"] / asyn["wall_s"]
    push_med = statistics.median(trainer.push_times) if trainer.push_times else 0.0
    return {
        "sync_samples_per_s": round(sync_sps, 3),
        "async_samples_per_s": round(async_sps, 3),
        "speedup": round(async_sps / sync_sps, 3),
        "sync_busy_ratio": round(sync["busy_s"] / sync["wall_s"] / len(urls), 3),
        "async_busy_ratio": round(asyn["busy_s"] / asyn["wall_s"] / len(urls), 3),
        "max_staleness_seen": max(sync["staleness_max"], asyn["staleness_max"]),
        "staleness_bound": async_cfg.max_staleness,
        "stale_policy": async_cfg.stale_policy.value, "max_token_age": async_cfg.max_token_age,
        "tokens_masked_old": asyn["tokens_masked_old"], "waits_for_old": asyn["waits_for_old"],
        "wait_for_old_s": round(asyn["wait_for_old_s"], 1),
        "samples_lost": asyn["samples_lost"],
        # the length bias: mean trained response length / mean generated length of finished samples
        "length_bias": round(asyn["lengths"]["length_bias"], 4),
        "trained_mean_len": round(asyn["lengths"]["trained_mean_len"], 1),
        "generated_mean_len": round(asyn["lengths"]["generated_mean_len"], 1),
        "tokens_dropped_by_length": {b: row["dropped_stale"] + row["dropped_filtered"] + row["dropped_failed"]
                                     for b, row in asyn["lengths"]["tokens_by_length"].items()},
        "samples_dropped_stale": asyn["samples_dropped"],
        "tokens_wasted_fraction": round(asyn["tokens_wasted"] / max(asyn["tokens_generated"], 1), 4),
        "tokens_wasted_fraction_server": round(1 - asyn["tokens_kept"] / max(asyn["server_gen_total"], 1), 4),
        # extras
        "sync_tokens_per_s": round(sync["tokens"] / sync["wall_s"], 1),
        "async_tokens_per_s": round(asyn["tokens"] / asyn["wall_s"], 1),
        "token_speedup": round((asyn["tokens"] / asyn["wall_s"]) / (sync["tokens"] / sync["wall_s"]), 3),
        "sync_mean_len": round(sync["mean_len"], 1), "async_mean_len": round(asyn["mean_len"], 1),
        # sync step time / the async trainer's own time per step: the speedup if generation were free
        "speedup_bound_trainer": round(sync["wall_s"] / (asyn["train_s"] + asyn["push_s"]), 3),
        "train_share_of_sync_step": round(sync["train_s"] / sync["wall_s"], 3),
        # server busy time per generated token: what each mode's batching makes a token cost
        "sync_ms_per_token": round(1000 * sync["busy_s"] / max(sync["server_tokens"], 1), 3),
        "async_ms_per_token": round(1000 * asyn["busy_s"] / max(asyn["server_tokens"], 1), 3),
        "sync_wall_s": round(sync["wall_s"], 1), "async_wall_s": round(asyn["wall_s"], 1),
        "sync_gen_s": round(sync["gen_s"], 1), "sync_train_s": round(sync["train_s"], 1),
        "sync_push_s": round(sync["push_s"], 1), "async_train_s": round(asyn["train_s"], 1),
        "async_push_s": round(asyn["push_s"], 1), "async_trainer_wait_s": round(asyn["trainer_wait_s"], 1),
        "push_median_s": round(push_med, 3),
        # the server's own view: mean rows per step and mean step time (busy seconds / steps)
        "sync_rows_per_step": round(sync["server_tokens"] / max(sync["server_steps"], 1), 1),
        "sync_step_ms": round(1000 * sync["busy_s"] / max(sync["server_steps"], 1), 2),
        "async_rows_per_step": round(asyn["server_tokens"] / max(asyn["server_steps"], 1), 1),
        "async_step_ms": round(1000 * asyn["busy_s"] / max(asyn["server_steps"], 1), 2),
        "staleness_hist": asyn["staleness_hist"], "drops": asyn["drops"], "stale_dropped": asyn["stale_dropped"],
        "samples_started": asyn["samples_started"], "samples_pending": asyn["samples_pending"],
        "tokens_aborted": asyn["tokens_aborted"], "server_aborted": asyn["server_aborted"],
        "async_server_gen_tokens": asyn["server_tokens"], "async_server_prompt_tokens": asyn["server_prompt_tokens"],
        "tokens_resumed": asyn["tokens_resumed"],
        "mean_inflight_at_batch": round(asyn["mean_inflight_at_batch"], 1),
        "server_version_start": v0, "server_version_end": max(sync["server_version_end"], asyn["server_version_end"]),
        "train_a_s": round(a, 4), "train_b_s_per_token": float(f"{b:.3e}"),
        "warmup_batch_s": [round(t, 2) for t in batch_times], "warmup_ms_per_token": round(1000 * gen_s_per_token, 3),
        "train_share_target": args.train_share, "mean_batch_tokens": round(mean_batch_tokens),
        "servers": len(urls), "steps": args.steps, "batch_size": args.batch_size, "group_size": args.group_size,
        "oversample": args.oversample, "async_inflight": async_cfg.max_inflight, "update_policy": args.update_policy, "abort_fraction": args.abort_fraction,
        "model": dict(MODEL), "median_tokens": args.median_tokens, "sigma": args.sigma, "align_capacity": args.align_capacity,
    }


def main(argv: list[str] | None = None) -> None:
    from rollout.config import RolloutConfig, StalePolicy
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40,
                   help="training steps of each mode (the async pipeline's fill and its partial samples at "
                        "the end weigh 1/steps)")
    p.add_argument("--batch-size", type=int, default=16, help="groups per training batch")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-running", type=int, default=64, help="server --max-running-requests and max_inflight")
    p.add_argument("--async-inflight", type=int, default=96,
                   help="max_inflight of (b): more rows make a decode step cheaper per token, but a sample "
                        "spans ~ length * inflight / tokens per batch versions, so more of them break "
                        "--max-staleness; 0: --max-running")
    p.add_argument("--median-tokens", type=float, default=64.0)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--oversample", type=float, default=4.0,
                   help="groups in progress per group a batch needs: with keep nothing is dropped for its age, "
                        "so a deep pipeline costs no waste (drop loses its long samples there: docs/long_tail.md)")
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--update-policy", default="abort_furthest", choices=["abort_furthest", "abort_all", "continue"])
    p.add_argument("--abort-fraction", type=float, default=0.5)
    p.add_argument("--stale-policy", default=RolloutConfig.stale_policy.value, choices=[x.value for x in StalePolicy],
                   help="default: the product's (RolloutConfig); docs/long_tail.md compares the four")
    p.add_argument("--max-token-age", type=int, default=-1,
                   help="stale-policy keep: mask tokens more than this many versions old (-1: none)")
    p.add_argument("--train-share", type=float, default=0.3,
                   help="what share of a synchronous step training takes (calibrated on the warm-up)")
    p.add_argument("--warmup-batches", type=int, default=4, help="untimed sync batches the train step is calibrated on")
    p.add_argument("--train-a", type=float, default=None)
    p.add_argument("--train-b", type=float, default=None)
    p.add_argument("--bucket-bytes", type=int, default=8 << 20)
    p.add_argument("--no-align-capacity", dest="align_capacity", action="store_false")
    p.add_argument("--hidden", type=int, default=None, help="model width (default 256; heads = hidden/64)")
    p.add_argument("--layers", type=int, default=None, help="model depth (default 4)")
    p.add_argument("--servers", type=int, default=2,
                   help="server processes behind the router (> 1: each decodes on one thread, no split)")
    p.add_argument("--order", default="abba", choices=["abba", "ab"],
                   help="abba: half the sync steps, the async run, the other half (cancels a drift in the "
                        "machine's speed); ab: all sync steps, then async")
    p.add_argument("--speculative", default="off", choices=["off", "auto", "on"],
                   help="the servers' --speculative (drafts from a group's siblings, verified by the policy), both modes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="4 steps, batch 8")
    p.add_argument("--server-log", default=None)
    p.add_argument("--verbose", action="store_true", help="rollout.* logs at INFO")
    args = p.parse_args(argv)
    if not 0 < args.train_share < 1:
        p.error(f"--train-share {args.train_share}: expected a fraction in (0, 1)")
    if args.servers < 1:
        p.error(f"--servers {args.servers}: expected at least 1")
    if args.warmup_batches < 1:
        p.error(f"--warmup-batches {args.warmup_batches}: the train step is calibrated on at least 1")
    if args.verbose:
        import logging
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        logging.getLogger("rollout").setLevel(logging.INFO)
    if args.quick:
        args.steps, args.batch_size = 4, 8

    from inference_server.process import ServerProcess, cpu_share_args
    path = model_dir(args.hidden, args.layers)
    server_args = ["--max-running-requests", str(args.max_running), "--context-length", "1200",
                   "--speculative", args.speculative, *cpu_share_args(args.servers)]
    t = time.monotonic()
    with contextlib.ExitStack() as stack:
        urls = []
        for i in range(args.servers):
            log_path = f"{args.server_log}.{i}" if args.server_log and args.servers > 1 else args.server_log
            urls.append(stack.enter_context(ServerProcess(path, args=server_args, log_path=log_path)).url)
        log(f"{args.servers} server(s) up at {', '.join(urls)} in {time.monotonic() - t:.1f}s")
        result = asyncio.run(bench(args, urls, path))
    result["speculative"] = args.speculative
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
