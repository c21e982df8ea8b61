"""The tail of a GRPO batch with speculative decoding off and auto, in one run (issue #53).

    python bench/spec_tail.py [--model PATH] [--prompts 8] [--samples 8] [--max-new-tokens 768]

Model: the real model `make setup-real` makes (SmolLM2-135M-Instruct) unless --model says otherwise, in
--dtype (bfloat16, as the real-model recipe's servers). One server of Riptide's (`python -m inference_server`, defaults but --speculative), started
twice: `--speculative off`, then `--speculative auto`; each takes the same three loads:

 (1) warm-up: 16 requests (other prompts), untimed;
 (2) the GRPO batch: --prompts gsm8k-style word problems (reasoning-gym's gsm_symbolic, chat template)
     x --samples samples, all sent at once, temperature 1, each sample with its own seed and its own
     length, LogNormal(ln --median-tokens, --sigma) clipped to [32, --max-new-tokens] (ignore_eos):
     long-tailed as a policy's answers are, and the same in both runs, so the wall times compare the
     same amount of work (the tokens themselves differ: float rounding differs with the batch's shape,
     and one flipped sample changes the rest of an answer; `same_tokens_fraction` says how many
     matched). batch_s: the first request to the last answer; tail_s: the answer at the 80th
     percentile to the last (the last 20% of requests, which run nearly alone).
 (3) a throughput row at batch 64: 64 other seeded requests of exactly --b64-tokens tokens each
     (ignore_eos), all at once: generated tokens per second, auto over off (`throughput_ratio_b64`).

Drafts: tokens_per_forward (generated tokens over sequence-forwards, the server's counters over
(2)) and acceptance (drafted tokens the policy accepted) of the auto server.

The result is one JSON line on stdout; logs go to stderr.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REAL_MODEL = ROOT / ".cache" / "smollm2-135m-instruct"


def log(msg: str) -> None:
    print(f"[spec_tail {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    import reasoning_gym
    data = reasoning_gym.create_dataset("gsm_symbolic", size=n, seed=seed)
    out = []
    for item in data:
        msgs = [{"role": "user", "content": item["question"] + "\nThink step by step, then give the answer."}]
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        out.append(list(tokenizer(text, add_special_tokens=False).input_ids))
    return out


async def batch(url: str, requests: list[tuple[list[int], dict]]) -> tuple[list[dict], list[float], float]:
    """Send every request at once; (their outputs, each one's finish time from the start, wall)."""
    import aiohttp
    t0 = time.monotonic()
    done = [0.0] * len(requests)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def one(i, ids, params):
            async with session.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": params,
                                                             "return_logprob": False}) as r:
                out = await r.json()
            done[i] = time.monotonic() - t0
            return out
        outs = await asyncio.gather(*(one(i, ids, p) for i, (ids, p) in enumerate(requests)))
    return outs, done, time.monotonic() - t0


def stats(url: str) -> dict:
    import requests
    return requests.get(f"{url}/get_server_info", timeout=30).json()["stats"]


def run_server(model: str, mode: str, loads: dict, a) -> dict:
    from bench._common import riptide_server
    with riptide_server(model, "--speculative", mode, "--speculative-tokens", str(a.speculative_tokens),
                        "--max-running-requests", "64", "--dtype", a.dtype, startup_timeout=300) as (url, _):
        asyncio.run(batch(url, loads["warmup"]))
        before = stats(url)
        outs, done, wall = asyncio.run(batch(url, loads["grpo"]))
        after = stats(url)
        ends = sorted(done)
        tail_from = ends[int(0.8 * len(ends)) - 1]
        d = {k: after[k] - before[k] for k in ("generation_tokens", "row_forwards", "spec_drafted", "spec_accepted",
                                               "spec_steps", "steps")}
        bad = [o for o in outs if "output_ids" not in o]
        if bad:
            sys.exit(f"{mode}: a request failed: {str(bad[0])[:500]}")
        tokens = [o["output_ids"] for o in outs]
        b64_outs, _, b64_wall = asyncio.run(batch(url, loads["b64"]))
        b64_tokens = sum(len(o["output_ids"]) for o in b64_outs)
    row = {"batch_s": round(wall, 3), "tail_s": round(wall - tail_from, 3),
           "tokens": sum(map(len, tokens)), "lengths_p50_max": [int(statistics.median(map(len, tokens))), max(map(len, tokens))],
           "tokens_per_forward": round(d["generation_tokens"] / max(1, d["row_forwards"]), 3),
           "acceptance": round(d["spec_accepted"] / d["spec_drafted"], 3) if d["spec_drafted"] else 0.0,
           "spec_steps": d["spec_steps"], "steps": d["steps"],
           "b64_tok_s": round(b64_tokens / b64_wall, 2)}
    log(f"{mode}: {row}")
    return {**row, "_tokens": tokens}


def length(a, item: int, index: int) -> int:
    """A sample's length: LogNormal(ln median, sigma) clipped to [32, --max-new-tokens], drawn from
    (seed, item, index), so both servers generate the same lengths."""
    x = random.Random(f"spec_tail-{a.seed}-{item}-{index}").lognormvariate(math.log(a.median_tokens), a.sigma)
    return int(min(a.max_new_tokens, max(32, round(x))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help=f"an HF folder (default: {REAL_MODEL}, made by make setup-real)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=768)
    p.add_argument("--median-tokens", type=float, default=160)
    p.add_argument("--sigma", type=float, default=0.7)
    p.add_argument("--b64-tokens", type=int, default=96)
    p.add_argument("--speculative-tokens", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", help="the servers' (bfloat16: the real-model recipe's, make demo-real)")
    a = p.parse_args()
    model = a.model or str(REAL_MODEL)
    if not (Path(model) / "config.json").exists():
        sys.exit(f"--model {model}: no HF folder there (make setup-real makes the default)")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    ps = prompts(tok, a.prompts + 2 + 8, a.seed)
    grpo_prompts, warm_prompts, b64_prompts = ps[:a.prompts], ps[a.prompts:a.prompts + 2], ps[a.prompts + 2:]
    loads = {
        "warmup": [(ids, {"max_new_tokens": 32, "temperature": 1.0, "seed": 1000 + i})
                   for i, ids in enumerate(warm_prompts * 8)],
        "grpo": [(ids, {"max_new_tokens": length(a, i, j), "temperature": 1.0, "ignore_eos": True,
                        "seed": 100 * i + j})
                 for i, ids in enumerate(grpo_prompts) for j in range(a.samples)],
        "b64": [(ids, {"max_new_tokens": a.b64_tokens, "temperature": 1.0, "ignore_eos": True, "seed": 5000 + 8 * i + j})
                for i, ids in enumerate(b64_prompts) for j in range(8)],
    }
    off = run_server(model, "off", loads, a)
    auto = run_server(model, "auto", loads, a)
    same = sum(x == y for x, y in zip(off.pop("_tokens"), auto.pop("_tokens"))) / len(loads["grpo"])
    result = {"tail_s_off": off["tail_s"], "tail_s_auto": auto["tail_s"],
              "batch_s_off": off["batch_s"], "batch_s_auto": auto["batch_s"],
              "tail_ratio": round(auto["tail_s"] / off["tail_s"], 3),
              "batch_ratio": round(auto["batch_s"] / off["batch_s"], 3),
              "tokens_per_forward": auto["tokens_per_forward"], "acceptance": auto["acceptance"],
              "throughput_ratio_b64": round(auto["b64_tok_s"] / off["b64_tok_s"], 3),
              "same_tokens_fraction": round(same, 3), "off": off, "auto": auto,
              "model": Path(model).name, "prompts": a.prompts, "samples": a.samples,
              "max_new_tokens": a.max_new_tokens, "speculative_tokens": a.speculative_tokens, "dtype": a.dtype}
    sys.stderr.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
