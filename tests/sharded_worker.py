"""One rank of a 2-rank FSDP2 job (gloo, CPU) that pushes its sharded model into a server; run by
tests/test_sharded.py as real processes (`python tests/sharded_worker.py`, env RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT as torchrun sets them).

    sharded_worker.py MODEL_PATH SERVER_URL[,URL...] VERSION OUT_JSON [--die-at-message N] [--bucket-kb K]
                      [--mode direct|gather] [--topology star|chain|tree]

Every rank loads the checkpoint, moves its weights by the same seeded noise (so they differ from
what the server loaded), shards it with fully_shard (each decoder layer, then the root) and calls
push_sharded. Rank 0 writes OUT_JSON: the push's outcome, the digest of the full (gathered) weights,
and the gathered model saved with save_pretrained (for a server to load) under OUT_JSON's dir.
`--die-at-message N`: rank 1 exits at once (os._exit) on rank 0's message N (0: the plan, then
one a bucket): a rank lost mid-push. `--mode direct|gather`: push_sharded's mode; `--topology`:
the WeightSync's, over the servers given. `--delta-steps N`: delta sync on (`WeightSync(delta=True)`),
and after the first push N more, each after every rank moved 2% of its own shard's elements (as
versions VERSION+1 ... VERSION+N); rank 0 records each push's mode, wire and changed fractions.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_path")
    p.add_argument("url")
    p.add_argument("version", type=int)
    p.add_argument("out")
    p.add_argument("--die-at-message", type=int, default=-1)
    p.add_argument("--bucket-kb", type=int, default=256)
    p.add_argument("--mode", default="direct")
    p.add_argument("--topology", default="star")
    p.add_argument("--delta-steps", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from weight_sync import live_digest, named_weights
    from weight_sync import sharded
    from weight_sync.sender import WeightSync, WeightSyncError

    model = AutoModelForCausalLM.from_pretrained(a.model_path, dtype=torch.float32)
    torch.manual_seed(a.version)                       # the same new weights on every rank
    with torch.no_grad():
        for t in model.parameters():
            t.add_(torch.randn_like(t) * 0.01)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert sharded.is_sharded(model)

    if rank == 1 and a.die_at_message >= 0:        # lose this rank after N buckets' gathers
        seen = [0]
        receive = sharded.listen

        def dying(group):
            if seen[0] == a.die_at_message:
                os._exit(3)
            seen[0] += 1
            return receive(group)
        sharded.listen = dying

    sync = WeightSync(a.url.split(","), bucket_bytes=a.bucket_kb << 10, timeout_s=20,
                      topology=a.topology, delta=a.delta_steps > 0) if rank == 0 else None
    state = sharded.RankState()                        # this rank's, kept between its pushes
    result: dict = {"rank": rank, "pushes": []}
    try:
        stats = sharded.push_sharded(model, a.version, sync, mode=a.mode, state=state)
        for step in range(1, a.delta_steps + 1):
            g = torch.Generator().manual_seed(1000 * step + rank)
            with torch.no_grad():
                for t in model.parameters():
                    local = t.to_local().view(-1)
                    at = torch.randperm(local.numel(), generator=g)[:max(1, local.numel() // 50)]
                    local[at] += 0.01
            stats = sharded.push_sharded(model, a.version + step, sync, mode=a.mode, state=state)
            result["pushes"].append({"modes": sorted(set(stats.modes.values())), "wire_fraction": stats.wire_fraction,
                                     "changed_fraction": stats.changed_fraction})
        result.update(ok=True, version=stats.version, buckets=stats.buckets, bytes=stats.bytes,
                      egress_by_rank=stats.egress_by_rank, peak_gathered_bytes=stats.peak_gathered_bytes)
    except WeightSyncError as e:
        result.update(ok=False, error=str(e))
    except Exception as e:                             # a lost rank shows as the group's own error on rank 0
        result.update(ok=False, error=f"{type(e).__name__}: {e}")
    finally:
        if sync is not None:
            sync.close()
    if a.die_at_message < 0:                        # the full weights, gathered for the check
        full = {n: (t.full_tensor() if isinstance(t, sharded._dtensor_type()) else t).detach()
                for n, t in named_weights(model).items()}
        result["digest"] = live_digest(full)
        result["model_bytes"] = sum(t.nbytes for t in full.values())
        if rank == 0:
            plain = AutoModelForCausalLM.from_pretrained(a.model_path, dtype=torch.float32)
            plain.load_state_dict(full, strict=False)
            saved = Path(a.out).parent / f"gathered-v{a.version}"
            plain.save_pretrained(saved)
            from transformers import AutoTokenizer
            AutoTokenizer.from_pretrained(a.model_path).save_pretrained(saved)
            result["saved"] = str(saved)
    Path(a.out + f".rank{rank}").write_text(json.dumps(result))
    if a.die_at_message < 0:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
