"""Multi-turn agent episodes with the host KV tier off and on, in one run (issue #54).

    python bench/multiturn.py [--model PATH] [--episodes 32] [--turns 6] [--host-gb 4]

Model: the real model `make setup-real` makes (SmolLM2-135M-Instruct) unless --model says otherwise,
in --dtype (bfloat16, as the real-model recipe's servers). One server of Riptide's started twice (the
tier off, then `--kv-host-gb --host-gb`), `--max-running-requests --episodes`, and a KV pool
(`--kv-cache-gb`) that holds a third of the episodes' contexts at their end (the tokens of every
episode's last turn, summed, over 3), so that while a tool runs, other episodes' turns evict its blocks.

Episodes: --episodes at once, --turns turns each. An episode's first prompt is a shared system prompt
(a calculator tool's description) and a table of numbers of its own with a question (about 800 tokens
in all); each turn streams an answer (up to 48 tokens, temperature 1, seeded), then the tool "runs"
(0.3-1.5 s, drawn) and its output (30-80 tokens, drawn) is appended to the episode, which is the next
turn's prompt, token for token: contexts grow to about 1.2k tokens. The draws are the same for both
servers.

Figures: prefill tokens the server computed (its `prompt_tokens` counter over the episodes), mean time
to first token of turns 2..N (from the request to the first streamed token), episodes per minute;
`prefill_ratio_tier` and `ttft_ratio_tier` are the tier's over none's (goals: <= 0.3 and <= 0.5).
Then the third run: two servers (the cores shared, `process.cpu_share_args`), each with the host tier and
Mooncake Store (a master on loopback, `kv_tier.StoreMaster`), every later turn of an episode sent to the
other server than its previous turn: `moved_turn_prefix_computed` is the share of those turns' prefixes
(the episode's tokens at the previous turn's end) that the server they moved to computed rather than
loaded (goal: <= 0.1).

The result is one JSON line on stdout; logs go to stderr.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REAL_MODEL = ROOT / ".cache" / "smollm2-135m-instruct"
SYSTEM = ("You are a careful assistant with a calculator tool. To use it, write CALC(expression) and stop; the "
          "tool answers with RESULT(value) on the next line. Use the table the user gives; check each step. ")


def log(msg: str) -> None:
    print(f"[multiturn {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def episodes(tok, n: int, seed: int, a_rows: int = 12) -> list[dict]:
    out = []
    for e in range(n):
        rng = random.Random(f"multiturn-{seed}-{e}")
        rows = "\n".join(f"row {i}: " + " ".join(str(rng.randrange(10, 999)) for _ in range(12)) for i in range(a_rows))
        msgs = [{"role": "system", "content": SYSTEM * 4},
                {"role": "user", "content": f"Table {e}:\n{rows}\nWhat is the sum of row {rng.randrange(a_rows)} "
                                            f"minus the largest value of row {rng.randrange(a_rows)}?"}]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = list(tok(text, add_special_tokens=False).input_ids)
        tools = []
        for t in range(16):
            n_tok = rng.randint(30, 80)
            tool = tok("\nRESULT(" + " ".join(str(rng.randrange(1000, 99999)) for _ in range(60)),
                       add_special_tokens=False).input_ids[:n_tok]
            tools.append((list(tool), rng.uniform(0.3, 1.5)))
        out.append({"ids": ids, "tools": tools})
    return out


async def run_episode(session, urls: list[str], ep: dict, index: int, turns: int, ttft: list, seed: int,
                      moved: list) -> int:
    """One episode's turns; with several servers, turn t goes to server (index + t) % servers: every
    later turn moves, and `moved` gets (its prefix: the episode's tokens at the previous turn's end,
    the prefix positions the server took from a cache)."""
    ids, prefix = list(ep["ids"]), 0
    for t in range(turns):
        url = urls[(index + t) % len(urls)]
        params = {"max_new_tokens": 48, "temperature": 1.0, "seed": seed * 1000 + index * 16 + t}
        t0 = time.monotonic()
        first, out = None, []
        async with session.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": params,
                                                         "stream": True}) as r:
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[5:])
                if first is None and msg.get("output_ids"):
                    first = time.monotonic() - t0
                out = msg.get("output_ids", out)
                cached = msg.get("meta_info", {}).get("cached_tokens", 0)
        if t > 0 and len(urls) > 1:
            moved.append((prefix, min(cached, prefix)))
        prefix = len(ids) + len(out)
        if t > 0:
            ttft.append(first if first is not None else time.monotonic() - t0)
        tool, wait = ep["tools"][t]
        ids = ids + list(out) + tool
        if t + 1 < turns:
            await asyncio.sleep(wait)
    return len(ids)


async def run_all(urls: list[str], eps: list[dict], turns: int, seed: int):
    import aiohttp
    ttft: list[float] = []
    moved: list[tuple[int, int]] = []
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        lengths = await asyncio.gather(*(run_episode(session, urls, ep, i, turns, ttft, seed, moved)
                                         for i, ep in enumerate(eps)))
    return ttft, time.monotonic() - t0, list(lengths), moved


def server_info(url: str) -> dict:
    import requests
    return requests.get(f"{url}/get_server_info", timeout=30).json()


def run_servers(model: str, extra: list[str], eps: list[dict], a, pool_gb: float, label: str, servers: int = 1) -> dict:
    import contextlib
    from bench._common import riptide_server
    from inference_server.process import cpu_share_args
    args = ["--dtype", a.dtype, "--max-running-requests", str(a.episodes), "--kv-cache-gb", f"{pool_gb:.4f}",
            "--context-length", str(a.context_length), *extra, *(cpu_share_args(servers) if servers > 1 else [])]
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(riptide_server(model, *args, startup_timeout=300))[0] for _ in range(servers)]
        before = [server_info(u) for u in urls]
        ttft, wall, lengths, moved = asyncio.run(run_all(urls, eps, a.turns, a.seed))
        after = [server_info(u) for u in urls]

    def delta(get) -> int:
        return sum(get(x) - get(y) for x, y in zip(after, before))
    row = {"prefill_tokens": delta(lambda i: i["stats"]["prompt_tokens"]), "ttft_s_mean": round(statistics.mean(ttft), 4),
           "ttft_s_p50": round(statistics.median(ttft), 4), "wall_s": round(wall, 2),
           "episodes_per_min": round(len(eps) / wall * 60, 2), "final_context_mean": round(statistics.mean(lengths)),
           "preemptions": delta(lambda i: i.get("preemptions", 0)),
           "cached_prompt_tokens": delta(lambda i: i.get("cached_prompt_tokens", 0)),
           "kv_tier": [x.get("kv_tier", {}) for x in after]}
    if moved:
        row["moved_turn_prefix_computed"] = round(1 - sum(c for _, c in moved) / sum(p for p, _ in moved), 4)
    log(f"{label}: {row}")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help=f"an HF folder (default: {REAL_MODEL}, made by make setup-real)")
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--host-gb", type=float, default=4.0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-store", dest="store", action="store_false", help="skip the two-server Mooncake Store run")
    a = p.parse_args()
    model = a.model or str(REAL_MODEL)
    if not (Path(model) / "config.json").exists():
        sys.exit(f"--model {model}: no HF folder there (make setup-real makes the default)")
    import torch
    from transformers import AutoConfig, AutoTokenizer
    from inference_server.kv_cache import kv_bytes_per_token
    tok = AutoTokenizer.from_pretrained(model)
    eps = episodes(tok, a.episodes, a.seed)
    # the contexts at their end: the first prompt, 48 tokens an answer at most, the tools' outputs
    final = sum(len(ep["ids"]) + sum(48 + len(t) for t, _ in ep["tools"][:a.turns]) for ep in eps)
    per_token = kv_bytes_per_token(AutoConfig.from_pretrained(model), getattr(torch, a.dtype))
    longest = max(len(ep["ids"]) + sum(48 + len(t) for t, _ in ep["tools"][:a.turns]) for ep in eps)
    a.context_length = -(-(longest + 64) // 128) * 128
    pool_gb = max(final / 3, a.context_length) * per_token / 2**30
    log(f"{a.episodes} episodes, first prompts {min(len(e['ids']) for e in eps)}-{max(len(e['ids']) for e in eps)} "
        f"tokens, contexts up to {final // a.episodes} at the end; pool {pool_gb:.3f} GiB (a third of them)")
    off = run_servers(model, [], eps, a, pool_gb, "tier off")
    host = run_servers(model, ["--kv-host-gb", str(a.host_gb)], eps, a, pool_gb, "host tier")
    store = None
    if a.store:
        from inference_server.kv_tier import StoreMaster
        with StoreMaster() as master:
            store = run_servers(model, ["--kv-host-gb", str(a.host_gb), "--kv-store-master", master.address,
                                        "--kv-store-metadata", master.metadata], eps, a, pool_gb,
                                "two servers, turns alternating, host tier + Mooncake Store", servers=2)
    result = {"prefill_ratio_tier": round(host["prefill_tokens"] / off["prefill_tokens"], 3),
              "ttft_ratio_tier": round(host["ttft_s_mean"] / off["ttft_s_mean"], 3),
              "episodes_per_min_ratio": round(host["episodes_per_min"] / off["episodes_per_min"], 3),
              "moved_turn_prefix_computed": store["moved_turn_prefix_computed"] if store else None,
              "off": off, "host": host, "store": store,
              "episodes": a.episodes, "turns": a.turns, "pool_gb": round(pool_gb, 4), "host_gb": a.host_gb,
              "dtype": a.dtype, "model": Path(model).name}
    sys.stderr.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
