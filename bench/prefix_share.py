"""Prefill tokens per GRPO group, with and without prefix sharing, in the same run.

    python bench/prefix_share.py [--groups 16] [--group-size 8] [--prompt-tokens 128] [--max-new-tokens 32]

GRPO sends each prompt n times. Without sharing the engine prefills it n times; with it
(the default, `--no-prefix-share` turns it off) a prompt that arrives in one step is computed once, and
one that a running sequence already holds in the KV cache is copied from it. The workload: groups
arrive one after another while earlier ones decode (2 groups in flight), each as n sequences with
the same prompt, as the rollout manager sends them. Same model, seeds and requests in both runs; the
tokens each sample gets are compared too.

Last line: one JSON object with prefill_tokens_per_group_before / _after, the ratio, the wall
seconds of each run and whether every sample's tokens were the same.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(model_path: str, share: bool, args) -> tuple[dict, list]:
    from inference_server.engine import Engine, EngineArgs
    from inference_server.sequence import SamplingParams, Sequence

    engine = Engine(EngineArgs(model_path, context_length=args.prompt_tokens + args.max_new_tokens + 8,
                               prefix_share=share))
    engine.start()
    try:
        finished = threading.Semaphore(0)
        in_flight = threading.Semaphore(2)                 # two groups generate at once
        seqs = []
        t0 = time.perf_counter()
        for g in range(args.groups):
            prompt = [(g * 7919 + i * 31) % 400 + 5 for i in range(args.prompt_tokens)]
            in_flight.acquire()
            group = [Sequence(f"g{g}-{i}", list(prompt),
                              SamplingParams(max_new_tokens=args.max_new_tokens, seed=g * 100 + i, ignore_eos=True))
                     for i in range(args.group_size)]
            left = [len(group)]

            def done(s, left=left):
                if s.finished:
                    finished.release()
                    left[0] -= 1
                    if left[0] == 0:
                        in_flight.release()
            for i, s in enumerate(group):
                s.on_update = done
                engine.add([s])                             # one request per sample, as the rollout client sends them
                if i == 0:
                    time.sleep(0.002)
            seqs += group
        for _ in seqs:
            finished.acquire(timeout=300)
        wall = time.perf_counter() - t0
        st = engine.stats
        return {"prefill_tokens": st.prompt_tokens, "shared_tokens": st.shared_prompt_tokens,
                "wall_s": round(wall, 3)}, [s.output_ids for s in seqs]
    finally:
        engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=32)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import transformers
    transformers.utils.logging.disable_progress_bar()
    from inference_server.tiny_model import build_tiny_model
    with tempfile.TemporaryDirectory(prefix="riptide_prefix_") as d:
        path = str(build_tiny_model(Path(d) / "model", hidden=384, layers=4, heads=6, kv_heads=2, vocab=512, seed=0))
        before, ids_before = run(path, False, args)
        after, ids_after = run(path, True, args)
    per = lambda r: round(r["prefill_tokens"] / args.groups, 1)   # noqa: E731
    out = {"prefill_tokens_per_group_before": per(before), "prefill_tokens_per_group_after": per(after),
           "prefill_ratio": round(before["prefill_tokens"] / max(1, after["prefill_tokens"]), 2),
           "wall_s_before": before["wall_s"], "wall_s_after": after["wall_s"],
           "speedup": round(before["wall_s"] / after["wall_s"], 3), "same_tokens": ids_before == ids_after,
           "params": {"groups": args.groups, "group_size": args.group_size, "prompt_tokens": args.prompt_tokens,
                      "max_new_tokens": args.max_new_tokens}}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
