"""Adapter-only pushes against whole pushes of the same LoRA model, into one of Riptide's servers, both
ways a server takes an adapter: served in the forward from the commit and merged beside the steps (the
default on the embedded engine's CPU path), and merged before the commit (weight_sync.adapter_merge).

    python bench/lora_sync.py [--model PATH|tiny] [--rank 16] [--rounds 3]

The model (by default the real one `make setup-real` makes: SmolLM2-135M-Instruct, fp32) gets a peft LoRA
adapter of `--rank` on the attention and MLP projections, its B drawn at random (a trained adapter's
shape; a fresh one computes nothing). For each way of serving it (a server of its own each): after one
adapter push that is not measured (a server takes its adapters' base at its first adapter update),
`--rounds` adapter pushes (`WeightSync.push_adapter`), the generation speed (32 greedy answers of 64
tokens at once), the server's greedy tokens and logprobs against the same server serving peft's
merge_and_unload weights pushed whole and against transformers' forward of that model (fp32), then
`--rounds` whole pushes of the merged weights (`WeightSync.push`, what a trainer without adapters sends).
Seconds are the pushes' wall time (stream, merge where merged, commit), medians over the rounds.

The last line is one JSON object: adapter_wire_fraction, adapter_push_s, full_push_s,
logprob_max_abs_diff_vs_peft and gen_tok_s (the default way), merge_s (the merge before the commit),
that way's figures under "merged_before_commit", and the settings."""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
REAL_MODEL = ROOT / ".cache" / "smollm2-135m-instruct"


def adapted(path: str, rank: int):
    from transformers import AutoModelForCausalLM

    from trainer_bridge.training import lora
    return lora.with_adapters(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), rank, 2.0 * rank, 0.0,
                              []).eval()


GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


def gaps(backend, model, prompts: list[list[int]], version: int) -> tuple[float, float]:
    """After an adapter push: the largest |logprob| difference of the server's greedy tokens (1) against
    the same server serving peft's merge_and_unload weights, pushed whole as the next version (the merge
    alone: same engine, same kernels), and (2) against transformers' forward of that model (the engine's
    own fp32 numerics included). Tokens must be equal in both."""
    reference = copy.deepcopy(model).merge_and_unload().eval()
    adapter_outs = backend.generate(prompts, GREEDY)
    backend.sync.push(dict(reference.named_parameters()), version)
    whole_outs = backend.generate(prompts, GREEDY)
    vs_peft = vs_hf = 0.0
    for ids, out, whole in zip(prompts, adapter_outs, whole_outs):
        with torch.no_grad():
            logits = reference(torch.tensor([ids + out.output_ids])).logits[0, len(ids) - 1:-1].float()
        if not out.output_ids == whole.output_ids == logits.argmax(-1).tolist():
            raise SystemExit("the server's greedy tokens differ from peft's merged model's")
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
        vs_peft = max(vs_peft, (torch.tensor(out.logprobs) - torch.tensor(whole.logprobs)).abs().max().item())
        vs_hf = max(vs_hf, (torch.tensor(out.logprobs) - want).abs().max().item())
    return vs_peft, vs_hf


def generation_tok_s(backend, tokenizer, n: int = 32, new_tokens: int = 64) -> float:
    """Greedy decoding of n prompts at once, new tokens a second (what serving the adapter costs)."""
    prompts = [tokenizer(f"Question {i}: what is {i} times {i + 3}? Answer:")["input_ids"] for i in range(n)]
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    backend.generate(prompts[:4], {**params, "max_new_tokens": 8})          # warm
    t = time.perf_counter()
    outs = backend.generate(prompts, params)
    return sum(len(o.output_ids) for o in outs) / (time.perf_counter() - t)


def one_mode(path: str, a, merge: bool) -> dict:
    """One server, the adapter served in the forward and merged beside the steps (merge=False, the
    default) or merged before the commit: `rounds` adapter pushes, generation speed, the logprob gaps, then `rounds` whole pushes of
    the merged weights (after which the server merges: its weights are no longer the base)."""
    from rollout.config import RolloutConfig
    from trainer_bridge.backend import BackendConfig, RolloutBackend
    from trainer_bridge.config import ServerConfig, WeightSyncConfig
    from riptide_testing.lora import draw_adapter
    from trainer_bridge.training import lora
    cfg = BackendConfig(path, server=ServerConfig(context_length=512, dtype="float32", device="cpu", kv_cache_gb=1.0),
                        rollout=RolloutConfig(max_new_tokens=32, use_chat_template="false"),
                        weight_sync=WeightSyncConfig(bucket_mb=a.bucket_mb, adapter_merge=merge))
    full, adapter, merge_s = [], [], []
    with RolloutBackend(cfg) as backend:
        backend.start(manager=False)
        # a first adapter push (not measured): each server takes the base of its adapters from what it
        # serves at its first adapter update (merging, a copy of it)
        model = draw_adapter(adapted(path, a.rank), 100, 0.01)
        backend.sync.push_adapter(*lora.adapter_tensors(model), lora.base_weights(model), 1)
        version = 1
        for r in range(a.rounds):
            draw_adapter(model, r, 0.01)          # the adapter as a training step leaves it
            version += 1
            tensors, scales = lora.adapter_tensors(model)
            stats = backend.sync.push_adapter(tensors, scales, lora.base_weights(model), version)
            adapter.append(stats.seconds)
            merge_s.append(stats.merge_s)
            fraction = stats.bytes / stats.model_bytes
        tok_s = generation_tok_s(backend, backend.tokenizer)
        prompts = [backend.tokenizer(t)["input_ids"] for t in ("The capital of France is", "2 + 2 =", "def f(x):")]
        version += 1
        vs_peft, vs_hf = gaps(backend, model, prompts, version)
        for r in range(a.rounds):
            draw_adapter(model, 50 + r, 0.01)
            version += 1
            full.append(backend.sync.push(lora.merged_weights(model), version).seconds)
        print(f"{'merged before the commit' if merge else 'in the forward, merged beside'}: adapter pushes {adapter}, merge {merge_s}, whole pushes "
              f"{full}, generation {tok_s:.1f} tok/s", file=sys.stderr, flush=True)
    return {"adapter_push_s": statistics.median(adapter), "full_push_s": statistics.median(full),
            "merge_s": statistics.median(merge_s), "fraction": fraction, "vs_peft": vs_peft, "vs_hf": vs_hf,
            "gen_tok_s": tok_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help=f"an HF folder, or tiny (default: {REAL_MODEL})")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bucket-mb", type=int, default=64)
    a = p.parse_args()
    if a.model == "tiny":
        from bench._common import tiny_model_dir
        path = str(tiny_model_dir())
    else:
        path = a.model or str(REAL_MODEL)
        if not (Path(path) / "config.json").exists():
            p.error(f"--model {path}: no config.json there (make setup-real makes the real model)")
    forward, merged = one_mode(path, a, merge=False), one_mode(path, a, merge=True)
    sys.stderr.flush()
    print(json.dumps({"adapter_wire_fraction": round(forward["fraction"], 5),
                      "adapter_push_s": round(forward["adapter_push_s"], 4),
                      "full_push_s": round(forward["full_push_s"], 4),
                      "merge_s": round(merged["merge_s"], 4),
                      "logprob_max_abs_diff_vs_peft": forward["vs_peft"],
                      "logprob_max_abs_diff_vs_transformers": forward["vs_hf"],
                      "adapter_over_full": round(forward["adapter_push_s"] / forward["full_push_s"], 3),
                      "gen_tok_s": round(forward["gen_tok_s"], 1),
                      "merged_before_commit": {"adapter_push_s": round(merged["adapter_push_s"], 4),
                                               "full_push_s": round(merged["full_push_s"], 4),
                                               "adapter_over_full": round(merged["adapter_push_s"] / merged["full_push_s"], 3),
                                               "logprob_max_abs_diff_vs_peft": merged["vs_peft"],
                                               "gen_tok_s": round(merged["gen_tok_s"], 1)},
                      "rank": a.rank, "rounds": a.rounds, "model": Path(path).name, "dtype": "float32",
                      "bucket_mb": a.bucket_mb}), flush=True)


if __name__ == "__main__":
    main()
