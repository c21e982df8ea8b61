"""`make demo` (for now): build a tiny model, start the server, send it a batch, print what came back."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import httpx

from inference_server.process import ServerProcess
from inference_server.tiny_model import build_tiny_model

PROMPTS = ["12 + 34 =", "reverse 123 ->", "the answer is", "copy 4 5 6:"]


def main() -> None:
    model_dir = Path(".cache/tiny-model")
    if not (model_dir / "config.json").exists():
        print(f"building a tiny random model in {model_dir}")
        build_tiny_model(model_dir)
    log = Path(tempfile.gettempdir()) / "riptide-demo-server.log"
    with ServerProcess(model_dir, log_path=log) as server:
        print(f"server up at {server.url} (log: {log})")
        r = httpx.post(f"{server.url}/generate", timeout=120, json={
            "text": PROMPTS, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 16, "temperature": 0.8, "seed": 0}})
        r.raise_for_status()
        for prompt, out in zip(PROMPTS, r.json()):
            meta = out["meta_info"]
            lps = [round(lp, 2) for lp, _, _ in meta["output_token_logprobs"][:4]]
            print(f"{prompt!r} -> {out['text']!r}\n    {meta['completion_tokens']} tokens, "
                  f"finish={meta['finish_reason']['type']}, version={meta['weight_version']}, logprobs[:4]={lps}")
        info = httpx.get(f"{server.url}/get_server_info").json()
        print(json.dumps({"prompts": len(PROMPTS), "generation_tokens": info["stats"]["generation_tokens"],
                          "runner": info["runner"], "weight_version": info["weight_version"]}))


if __name__ == "__main__":
    main()
