"""The host KV tier (inference_server/kv_tier.py): a multi-turn episode's next turn whose blocks the
pool evicted loads them from host memory instead of prefilling them, with the tokens and logprobs of a
fresh prefill; a corrupted tier block is detected and recomputed; blocks made under other weights are
not used, but by a request that keeps old KV (kv_policy continue), which says which weights made them."""
from __future__ import annotations

import random

import pytest
import torch

from inference_server.engine import Engine, EngineArgs
from inference_server.sequence import SamplingParams, Sequence
from inference_server.kv_cache import kv_bytes_per_token


def engine(model: str, host_gb: float, **kw) -> Engine:
    # a pool of 12 blocks of 16 positions: two 80-token episodes evict each other's blocks
    from transformers import AutoConfig
    per_block = kv_bytes_per_token(AutoConfig.from_pretrained(model), torch.float32) * 16
    return Engine(EngineArgs(model, context_length=192, cpu_split=False, kv_layout="paged", kv_block_size=16,
                             kv_cache_gb=12 * per_block / 2**30, max_running_requests=2, kv_host_gb=host_gb, **kw))


def run(e: Engine, seqs: list[Sequence]) -> list[Sequence]:
    e.add(seqs)
    with torch.inference_mode():
        while True:
            e._run_commands()
            if not e.scheduler.has_work:
                return seqs
            e.step()


def episode_turns(e: Engine, prompts: list[list[int]], turns: int = 3, tool: int = 20) -> list[list[Sequence]]:
    """Turns of several episodes, one turn of each at a time: each turn's prompt is the episode so
    far (its last turn's prompt and answer) and a tool's output."""
    rng = random.Random(1)
    history, out = [list(p) for p in prompts], []
    for t in range(turns):
        seqs = [Sequence(f"e{i}-t{t}", list(h), SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
                for i, h in enumerate(history)]
        run(e, seqs)
        out.append(seqs)
        for i, s in enumerate(seqs):
            history[i] = s.prompt_ids + s.output_ids + [rng.randrange(20, 1900) for _ in range(tool)]
    return out


def test_a_turn_loads_its_evicted_prefix_from_the_host_tier_and_answers_as_a_fresh_prefill(tiny_model, hf_model):
    rng = random.Random(0)
    prompts = [[rng.randrange(20, 1900) for _ in range(70)] for _ in range(3)]
    with_tier = engine(tiny_model, host_gb=0.05)
    turns = episode_turns(with_tier, prompts)
    stats = with_tier.tier_stats()
    assert stats["saved_blocks"] > 0 and stats["loaded_blocks"] > 0 and stats["corrupt_blocks"] == 0, stats
    assert any(s.cached_tokens for s in turns[-1])
    without = engine(tiny_model, host_gb=0)
    fresh = episode_turns(without, prompts)
    assert with_tier.stats.prompt_tokens < without.stats.prompt_tokens
    for a, b in zip(turns, fresh):
        for s, f in zip(a, b):
            assert s.output_ids == f.output_ids
            assert torch.allclose(torch.tensor(s.output_logprobs), torch.tensor(f.output_logprobs), atol=1e-5)
    # and against transformers' recompute of the last turn
    s = turns[-1][0]
    with torch.no_grad():
        logits = hf_model(torch.tensor([s.prompt_ids + s.output_ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    n = len(s.prompt_ids)
    want = torch.tensor([lp[n + j - 1, t] for j, t in enumerate(s.output_ids)])
    assert torch.allclose(torch.tensor(s.output_logprobs), want, atol=1e-4)


def test_a_corrupted_tier_block_is_detected_and_recomputed(tiny_model):
    rng = random.Random(0)
    prompts = [[rng.randrange(20, 1900) for _ in range(70)] for _ in range(3)]
    e = engine(tiny_model, host_gb=0.05)
    tier = e.scheduler.blocks.tier.host
    real_save = tier.save

    def save_then_corrupt(*a):
        real_save(*a)
        slot = tier.entries[(a[1], a[4])][0]
        tier.store[slot, 0, 0, 0, 0, 0] += 1.0              # a flipped value after the digest was taken
    tier.save = save_then_corrupt
    turns = episode_turns(e, prompts)
    stats = e.tier_stats()
    assert stats["corrupt_blocks"] > 0 and stats["loaded_blocks"] == 0, stats
    fresh = episode_turns(engine(tiny_model, host_gb=0), prompts)
    assert [[s.output_ids for s in t] for t in turns] == [[s.output_ids for s in t] for t in fresh]


def test_tier_blocks_made_under_other_weights_are_not_used(tiny_model, tiny_model_v2):
    from inference_server import weights
    from transformers import AutoModelForCausalLM
    rng = random.Random(0)
    prompts = [[rng.randrange(20, 1900) for _ in range(70)] for _ in range(3)]
    e = engine(tiny_model, host_gb=0.05)
    episode_turns(e, prompts, turns=2)
    assert e.tier_stats()["host_entries"] > 0
    new = {n: p.detach().clone() for n, p in
           weights.parameters(AutoModelForCausalLM.from_pretrained(tiny_model_v2, dtype=torch.float32)).items()}
    e.swap_weights(new, 1)
    e._run_commands()
    loaded = e.tier_stats()["loaded_blocks"]
    seqs = run(e, [Sequence("after", list(prompts[0]), SamplingParams(max_new_tokens=4, temperature=0.0))])
    assert e.tier_stats()["loaded_blocks"] == loaded and seqs[0].cached_tokens == 0
    assert e.tier_stats()["host_entries"] == 0


def test_old_weights_kv_serves_only_a_request_that_keeps_old_kv_and_it_reports_the_age(tiny_model, tiny_model_v2):
    """kv_keep_versions=1: after a push, a fresh request computes its whole prompt under the new weights;
    one sent with keep_old_kv (kv_policy "continue") takes the blocks the old weights made, from the pool
    or the host tier, its kv_versions say which positions are old, and its logprobs are those of the new
    weights attending to the old keys and values (transformers: v1's cache of the prefix, v2 over the rest)."""
    from inference_server import weights
    from transformers import AutoModelForCausalLM, DynamicCache
    rng = random.Random(0)
    prompts = [[rng.randrange(20, 1900) for _ in range(70)] for _ in range(3)]
    e = engine(tiny_model, host_gb=0.05, kv_keep_versions=1)
    last = episode_turns(e, prompts, turns=2)[-1]
    v2 = AutoModelForCausalLM.from_pretrained(tiny_model_v2, dtype=torch.float32).eval()
    e.swap_weights({n: p.detach().clone() for n, p in weights.parameters(v2).items()}, 1)
    e._run_commands()
    turns = [s.prompt_ids + s.output_ids + [rng.randrange(20, 1900) for _ in range(10)] for s in last]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    loaded = e.tier_stats()["loaded_blocks"]
    old = run(e, [Sequence(f"old{i}", list(t), greedy, keep_old_kv=True) for i, t in enumerate(turns)])
    assert e.tier_stats()["loaded_blocks"] > loaded                # some of it from the host tier
    for s, t in zip(old, turns):
        c = s.cached_tokens
        assert c >= 64 and s.kv_versions == [[0, c, 0], [c, len(t), 1]] and s.prefill_version == 0
        assert s.output_versions == [1] * 6
    # neither the old blocks nor those computed over them serve a request of the new weights
    loaded = e.tier_stats()["loaded_blocks"]
    fresh = run(e, [Sequence(f"fresh{i}", list(t), greedy) for i, t in enumerate(turns)])
    assert all(s.cached_tokens == 0 and s.kv_versions == [[0, len(t), 1]] for s, t in zip(fresh, turns))
    assert e.tier_stats()["loaded_blocks"] == loaded
    with torch.no_grad():
        logits = v2(torch.tensor([turns[0] + fresh[0].output_ids])).logits[0]
    assert fresh[0].output_ids == [int(logits[len(turns[0]) + j - 1].argmax()) for j in range(6)]
    v1 = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    s, t = old[0], turns[0]
    c = s.cached_tokens
    with torch.no_grad():
        cache = DynamicCache()
        v1(torch.tensor([t[:c]]), cache=cache, use_cache=True)
        logits = v2(torch.tensor([t[c:] + s.output_ids]), cache=cache, use_cache=True).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    n = len(t) - c
    assert s.output_ids == [int(lp[n + j - 1].argmax()) for j in range(6)]
    want = torch.tensor([lp[n + j - 1, tok] for j, tok in enumerate(s.output_ids)])
    assert torch.allclose(torch.tensor(s.output_logprobs), want, atol=1e-4)


def test_an_ended_episodes_blocks_go_first_and_not_into_the_tier(tiny_model):
    """Episode B's turn finished first, then A's (so B's blocks are the older idle ones); A is said over
    (end_episode, its prompt shared): a newcomer that needs room evicts A's own blocks, not B's, and the host
    tier is not given them. Without the call, B's next turn would find its prefix gone."""
    rng = random.Random(5)
    b_prompt = [rng.randrange(20, 1900) for _ in range(70)]
    a_prompt = [rng.randrange(20, 1900) for _ in range(40)]
    newcomer = [rng.randrange(20, 1900) for _ in range(85)]
    sp = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    results = {}
    for end in (False, True):
        e = engine(tiny_model, host_gb=0.05 if end else 0)
        b = run(e, [Sequence("b", list(b_prompt), sp)])[0]
        a = run(e, [Sequence("a", list(a_prompt), SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True))])[0]
        if end:
            done = e.end_episode(a.all_ids, len(a_prompt))
            e._run_commands()
            assert done.result(timeout=10) == 2           # A's 4 cached blocks but the 2 of its (shared) prompt
        run(e, [Sequence("c", list(newcomer), SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))])
        saved = e.tier_stats().get("saved_blocks")                # C's room came from A's own blocks, not saved
        turn = b.all_ids + [rng.randrange(20, 1900) for _ in range(10)]
        results[end] = (run(e, [Sequence("b2", turn, sp)])[0].cached_tokens, saved)
    assert results[False][0] == 0
    assert results[True] == (16 * ((len(b_prompt) + 10 - 1) // 16), 0)


def test_a_host_tier_without_the_paged_cache_is_refused_by_name(tiny_model):
    with pytest.raises(ValueError, match="kv_host_gb"):
        Engine(EngineArgs(tiny_model, context_length=128, kv_layout="contiguous", kv_host_gb=1.0))


@pytest.fixture(scope="module")
def store_master(tmp_path_factory):
    pytest.importorskip("mooncake.store")
    from inference_server.kv_tier import StoreMaster
    master = StoreMaster(log_path=str(tmp_path_factory.mktemp("store") / "master.log")).start()
    yield master
    master.stop()
    assert master.proc.poll() is not None


def store_engine(model: str, master, **kw) -> Engine:
    return Engine(EngineArgs(model, context_length=256, cpu_split=False, kv_layout="paged", kv_block_size=16,
                             kv_store_master=master.address, kv_store_metadata=master.metadata,
                             kv_store_namespace=kw.pop("namespace", "test"), **kw))


def test_a_turn_moved_to_another_server_loads_its_prefix_from_the_store(tiny_model, store_master):
    rng = random.Random(3)
    prompt = [rng.randrange(20, 1900) for _ in range(70)]
    a, b, fresh = store_engine(tiny_model, store_master), store_engine(tiny_model, store_master), engine(tiny_model, 0)
    try:
        first = run(a, [Sequence("t0", list(prompt), SamplingParams(max_new_tokens=12, temperature=0.0))])[0]
        a.scheduler.blocks.tier.store.flush()
        assert a.tier_stats()["store_published_blocks"] >= 4
        turn = first.prompt_ids + first.output_ids + [rng.randrange(20, 1900) for _ in range(20)]
        moved = run(b, [Sequence("t1", list(turn), SamplingParams(max_new_tokens=12, temperature=0.0))])[0]
        want = run(fresh, [Sequence("t1", list(turn), SamplingParams(max_new_tokens=12, temperature=0.0))])[0]
        stats = b.tier_stats()
        # the first turn's full blocks (all its positions but the last token's) came from the store; the
        # moved turn computed only what is new in it
        held = (first.num_tokens - 1) // 16
        assert stats["store_loaded_blocks"] == held and moved.cached_tokens == 16 * held
        assert b.stats.prompt_tokens == len(turn) - 16 * held
        assert moved.output_ids == want.output_ids
        assert torch.allclose(torch.tensor(moved.output_logprobs), torch.tensor(want.output_logprobs), atol=1e-5)
    finally:
        for e in (a, b):
            e.shutdown()


def test_a_corrupted_store_block_is_detected_and_recomputed(tiny_model, store_master):
    rng = random.Random(4)
    prompt = [rng.randrange(20, 1900) for _ in range(40)]
    a, b = store_engine(tiny_model, store_master, namespace="bad"), store_engine(tiny_model, store_master, namespace="bad")
    try:
        first = run(a, [Sequence("t0", list(prompt), SamplingParams(max_new_tokens=4, temperature=0.0))])[0]
        store = a.scheduler.blocks.tier.store
        store.flush()
        # another writer's garbage under the first block's key: same length, other bytes
        key = next(k for k in store.published if k.startswith("bad/0/"))
        value = bytearray(store.client.get(key))
        value[-1] ^= 0xFF
        assert store.client.upsert(key, bytes(value)) == 0
        assert store.client.get(key) == bytes(value)
        turn = first.prompt_ids + first.output_ids + [5, 6, 7]
        got = run(b, [Sequence("t1", list(turn), SamplingParams(max_new_tokens=6, temperature=0.0))])[0]
        want = run(engine(tiny_model, 0), [Sequence("t1", list(turn), SamplingParams(max_new_tokens=6, temperature=0.0))])[0]
        assert b.tier_stats()["store_corrupt_blocks"] >= 1
        assert got.output_ids == want.output_ids
    finally:
        for e in (a, b):
            e.shutdown()


def test_the_fleets_store_master_stops_with_it_also_when_the_job_fails(tiny_model, tmp_path):
    pytest.importorskip("mooncake.store")
    from trainer_bridge.config import ServerConfig, WeightSyncConfig
    from trainer_bridge.fleets.local import LocalFleet
    fleet = LocalFleet(tiny_model, ServerConfig(kv_store="mooncake", kv_host_gb=0.1, context_length=256,
                                                kv_layout="paged"), WeightSyncConfig(), log_dir=str(tmp_path))
    fleet.server.validate()
    with pytest.raises(RuntimeError, match="the job failed"):
        try:
            urls = fleet.launch(1, version=0)
            import requests
            info = requests.get(f"{urls[0]}/get_server_info", timeout=30).json()
            assert info["kv_store_master"] == fleet.store_master.address and info["kv_host_gb"] == 0.1
            assert fleet.store_master.proc.poll() is None
            raise RuntimeError("the job failed")
        finally:
            fleet.close()
    assert fleet.store_master.proc.poll() is not None
    assert all(p.proc.poll() is not None for p in fleet.procs.values()) and not fleet.procs
