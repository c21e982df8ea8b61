"""Riptide's verl plugin on CPU: two Riptide servers behind verl's server handle, and one weight update
through the `riptide` checkpoint engine in the order verl's CheckpointEngineManager calls it.

    make setup-verl
    .venv-verl/bin/python examples/verl_engine.py

A verl job on GPUs takes the same parts by config (docs/integrations.md, "Use Riptide from verl").
"""
import asyncio
import os

import httpx
import torch
from transformers import AutoModelForCausalLM

from inference_server.tiny_model import build_tiny_model
from trainer_bridge.integrations.verl import RiptideCheckpointEngine, RiptideServer, RiptideServerAdapter


async def update_weights(actors, rollouts, adapter, model, step):
    """What CheckpointEngineManager.update_weights does between its abort and its resume."""
    metadata = [e.prepare() for e in actors + rollouts]
    actor_kw, rollout_kw = RiptideCheckpointEngine.build_topology(len(actors), len(rollouts), metadata)
    for group, kw in ((actors, actor_kw), (rollouts, rollout_kw)):
        for i, engine in enumerate(group):
            engine.init_process_group(**{k: v[i] for k, v in kw.items()})
    weights = lambda: ((n, p.detach()) for n, p in model.named_parameters())   # noqa: E731 (get_per_tensor_param)
    results = await asyncio.gather(*(a.send_weights(weights(), global_steps=step) for a in actors),
                                   *(adapter.update_weights(r.receive_weights(global_steps=step)) for r in rollouts))
    for engine in actors + rollouts:
        engine.finalize()
    return results[0]


async def main() -> None:
    path = ".cache/tiny-verl"
    if not os.path.exists(os.path.join(path, "config.json")):
        build_tiny_model(path, hidden=128, layers=2, heads=4, kv_heads=2, vocab=2000, seed=0)
    servers = [RiptideServer(path, response_length=8) for _ in range(2)]     # verl's server handles
    actors = [RiptideCheckpointEngine(1 << 20, is_master=(rank == 0)) for rank in range(2)]   # 2 trainer ranks
    rollouts = [RiptideCheckpointEngine(1 << 20, server_url=s.url) for s in servers]
    adapter = RiptideServerAdapter.__new__(RiptideServerAdapter)            # verl builds it from its configs
    try:
        prompt, greedy = [11, 12, 13, 14], dict(temperature=0.0, max_tokens=6, logprobs=True)
        before = await servers[0].generate(prompt, dict(greedy), request_id="before")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():                                              # "a training step"
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        metrics = await update_weights(actors, rollouts, adapter, model, step=1)
        after = await servers[0].generate(prompt, dict(greedy), request_id="after")
        digests = {httpx.get(f"{s.url}/weight_sync/digest", timeout=60).json()["digest"] for s in servers}
        print(f"pushed {metrics['riptide/push_bytes'] / 1e6:.1f} MB to {metrics['riptide/servers']:.0f} servers "
              f"in {metrics['riptide/push_s']:.2f} s; one digest on both: {len(digests) == 1}")
        print(f"before: {before.token_ids} (versions {before.extra_fields['weight_versions']})")
        print(f"after:  {after.token_ids} (versions {after.extra_fields['weight_versions']})")
        for s in servers:
            await s.close()
    finally:
        actors[0].close()
        for s in servers:
            s.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
