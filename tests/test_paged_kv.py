"""The paged KV cache (the default under a KV budget): the same tokens and logprobs as the contiguous slot cache
on mixed batches (prefill + decode, a GRPO group's shared prompt, aborts, a retract and resume,
sequences preempted when blocks run out), no block leaked over thousands of requests, and a KV
budget that is honoured and checked before anything starts."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from inference_server.blocks import BlockAllocator
from inference_server.engine import Engine, EngineArgs, PauseMode
from inference_server.sequence import SamplingParams, Sequence


def engine(model, **kw) -> Engine:
    kw.setdefault("kv_layout", "paged")
    kw.setdefault("kv_block_size", 16)               # small blocks: many of them, shared and freed at 16-token edges
    return Engine(EngineArgs(model, context_length=256, cpu_split=False, **kw))


def run(e: Engine, waves: dict[int, list[Sequence]], actions: dict[int, callable] | None = None,
        max_steps: int = 5000) -> int:
    """Step `e` on this thread: wave k's requests arrive before step k, actions[k] runs there too
    (as engine commands do, between steps). Returns the steps taken."""
    actions = actions or {}
    with torch.inference_mode():
        for step in range(max_steps):
            if step in waves:
                e.add(waves[step])
            if step in actions:
                actions[step](e)
            e._run_commands()
            if not e.scheduler.has_work and step > max(waves, default=0) and step > max(actions, default=0):
                return step
            if e.scheduler.has_work:
                e.step()
    raise AssertionError("the engine did not finish its requests")


def workload(seed: int) -> dict[int, list[Sequence]]:
    """Mixed prompt lengths, greedy and seeded rows, a group of 6 with one prompt (GRPO), arriving
    in waves while earlier ones decode."""
    rng = random.Random(seed)
    waves = {}
    for k in (0, 3, 4, 9, 20):
        batch = []
        for i in range(rng.randint(2, 5)):
            n = rng.choice([1, 5, 16, 17, 33, 70])
            greedy = i % 2 == 0
            batch.append(Sequence(f"w{k}-{i}", [rng.randrange(20, 1900) for _ in range(n)],
                                  SamplingParams(max_new_tokens=rng.randint(3, 40), ignore_eos=True,
                                                 temperature=0.0 if greedy else 0.9, seed=None if greedy else i)))
        waves[k] = batch
    prompt = [rng.randrange(20, 1900) for _ in range(37)]
    waves[5] = [Sequence(f"g{i}", list(prompt), SamplingParams(max_new_tokens=25, ignore_eos=True, seed=i))
                for i in range(3)]
    waves[8] = [Sequence(f"g{i}", list(prompt), SamplingParams(max_new_tokens=25, ignore_eos=True, seed=i))
                for i in range(3, 6)]                  # joins the group's first three while they decode
    return waves


def outputs(waves) -> dict[str, tuple[list[int], list[float], str]]:
    return {s.rid: (s.output_ids, s.output_logprobs, s.finish_reason["type"]) for w in waves.values() for s in w}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid][0] == b[rid][0], rid
        assert a[rid][2] == b[rid][2], rid
        assert max((abs(x - y) for x, y in zip(a[rid][1], b[rid][1])), default=0) < 1e-4, rid


def test_paged_gives_the_contiguous_caches_tokens_and_logprobs_on_mixed_batches(tiny_model):
    actions = {12: lambda e: e.abort("w9-1"),                      # an abort mid-decode
               14: lambda e: e.pause(PauseMode.RETRACT),           # every KV block given back ...
               16: lambda e: e.resume()}                           # ... and re-prefilled
    got = {}
    for layout in ("contiguous", "paged", "paged, gathered", "paged, small workspace"):
        e = engine(tiny_model, kv_layout=layout.split(",")[0], seed=3)
        if layout == "paged":
            assert e.runner.kernel is not None             # decode attention read in place (paged_attention.c)
        if "," in layout:
            e.runner.kernel = None                         # the fallback: blocks gathered into a workspace,
            e.runner.kv_writer = None                      # keys and values written by index_copy_
        if layout.endswith("workspace"):
            e.runner.workspace_positions = 40              # a chunk of rows gathered in several calls
        waves = workload(0)
        run(e, waves, dict(actions))
        got[layout] = outputs(waves)
        assert got[layout]["w9-1"][2] == "abort"
        if layout != "contiguous":
            assert e.stats.shared_prompt_tokens > 0                # the group's prompt was held once
            assert e.scheduler.blocks.num_free == e.scheduler.blocks.num_blocks
    for layout in ("paged", "paged, gathered", "paged, small workspace"):
        assert_same(got[layout], got["contiguous"])


def test_a_groups_prompt_blocks_are_held_once_by_reference(tiny_model):
    e = engine(tiny_model, seed=0)
    prompt = list(range(100, 140))                   # 40 tokens: 2 full blocks of 16, 8 in a third
    group = [Sequence(f"g{i}", list(prompt), SamplingParams(max_new_tokens=5, ignore_eos=True, seed=i))
             for i in range(4)]
    e.add(group)
    with torch.inference_mode():
        e._run_commands()
        e.step()
    first = group[0].blocks
    for s in group[1:]:
        assert s.blocks[:2] == first[:2] and s.blocks[2] != first[2]      # full blocks shared, the partial one own
    assert [e.scheduler.blocks.refs(b) for b in first[:2]] == [4, 4]


def test_sequences_preempted_when_blocks_run_out_finish_with_the_tokens_they_would_have(tiny_model):
    """A pool far too small for everyone at once: the newest running sequences are preempted, wait,
    and re-prefill prompt + output; every one still generates all its tokens (no truncation), the
    same greedy tokens as with room for all."""
    def make():
        rng = random.Random(1)
        return {0: [Sequence(f"p{i}", [rng.randrange(20, 1900) for _ in range(rng.randint(5, 30))],
                             SamplingParams(max_new_tokens=60, ignore_eos=True, temperature=0.0)) for i in range(8)]}
    roomy, tight = make(), make()
    run(engine(tiny_model), roomy)
    per_block = 2 * 2 * 2 * 32 * 4 * 16              # layers, K and V, KV heads, head size, fp32, positions
    e = engine(tiny_model, kv_cache_gb=20 * per_block / 2**30)    # 20 blocks: 320 positions, the 8 need ~600
    run(e, tight)
    assert e.scheduler.preemptions > 0
    assert all(len(s.output_ids) == 60 for s in tight[0])
    assert [s.output_ids for s in tight[0]] == [s.output_ids for s in roomy[0]]
    assert e.scheduler.blocks.num_free == e.scheduler.blocks.num_blocks


def test_no_block_is_leaked_after_thousands_of_requests(tiny_model):
    e = engine(tiny_model, max_running_requests=48, kv_cache_gb=24 * 2 * 2 * 2 * 32 * 4 * 16 / 2**30)
    blocks = e.scheduler.blocks
    rng = random.Random(2)
    waves, n = {}, 0
    for k in range(0, 480, 2):
        prompt = [rng.randrange(20, 1900) for _ in range(rng.randint(1, 40))]
        waves[k] = [Sequence(f"r{n + i}", list(prompt), SamplingParams(max_new_tokens=rng.randint(1, 12), seed=i))
                    for i in range(rng.choice([1, 1, 4, 8]))]
        waves[k] += [Sequence(f"r{n + 100 + i}", [rng.randrange(20, 1900) for _ in range(rng.randint(1, 60))],
                              SamplingParams(max_new_tokens=rng.randint(1, 120), temperature=0.0)) for i in range(6)]
        n += 200
    actions = {k: (lambda e, k=k: e.abort(f"r{k * 100 + 100}")) for k in range(1, 480, 7)}   # a running one
    actions.update({150: lambda e: e.pause(PauseMode.RETRACT), 152: lambda e: e.resume(),
                    250: lambda e: e.pause(PauseMode.IN_PLACE), 251: lambda e: e.resume()})
    run(e, waves, actions, max_steps=20000)
    total = sum(len(w) for w in waves.values())
    assert total > 2000 and all(s.finished for w in waves.values() for s in w)
    assert e.stats.aborted_requests > 0
    assert e.scheduler.preemptions > 0 and e.stats.shared_prompt_tokens > 0
    assert blocks.num_free == blocks.num_blocks and all(blocks.refs(b) == 0 for b in range(blocks.num_blocks))


def test_the_kv_budget_is_honoured_and_one_too_small_is_refused_before_anything_starts(tiny_model, monkeypatch):
    per_token = 2 * 2 * 2 * 32 * 4
    e = engine(tiny_model, kv_cache_gb=1000 * per_token / 2**30)
    assert e.scheduler.blocks.num_blocks == 1000 // 16
    assert e.runner.kv.nbytes <= 1000 * per_token
    slots = engine(tiny_model, kv_layout="contiguous", kv_cache_gb=3 * 256 * per_token / 2**30)
    assert slots.max_running == 3                                  # three full-context slots fit the same kind of budget
    with pytest.raises(ValueError, match="--kv-cache-gb"):
        engine(tiny_model, kv_cache_gb=100 * per_token / 2**30)     # not one sequence at context 256
    with pytest.raises(ValueError, match="kv_layout"):
        engine(tiny_model, kv_layout="ring")
    assert engine(tiny_model, kv_layout="auto", kv_cache_gb=0.01).scheduler.blocks is not None   # a budget: paged
    assert engine(tiny_model, kv_layout="auto").scheduler.blocks is not None  # CPU, no budget, the C kernel: paged
    monkeypatch.setattr("inference_server.engine.decode_kernel", lambda *a: None)
    assert engine(tiny_model, kv_layout="auto").scheduler.blocks is None      # no kernel: the slots, faster then


def test_a_server_whose_kv_budget_cannot_hold_one_sequence_says_so_and_exits(tiny_model, tmp_path):
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "inference_server", "--model-path", tiny_model, "--port", "0",
                           "--context-length", "1024", "--kv-cache-gb", "0.0001"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--kv-cache-gb" in done.stderr and "context 1024" in done.stderr and "Traceback" not in done.stderr


def test_the_block_allocator_refuses_what_would_corrupt_it():
    a = BlockAllocator(4, 16)
    x = a.alloc(3)
    assert a.num_free == 1 and a.needed(x, 49) == 1 and a.needed(x, 48) == 0
    a.ref(x[:1])
    a.free(x)
    assert a.num_free == 3                               # x[0] still held by its second holder
    with pytest.raises(ValueError, match="freed twice"):
        a.free(x[1:2])
    with pytest.raises(ValueError, match="is free"):
        a.ref(x[1:2])
    a.free(x[:1])
    assert a.num_free == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,group,block_size", [(64, 3, 16), (64, 3, 128), (128, 1, 32), (40, 4, 8)])
def test_the_in_place_kernel_attends_as_sdpa_over_gathered_blocks(head_dim, group, block_size, dtype):
    """paged_attention.c against SDPA over each row's blocks gathered in order: ragged rows (one
    position, a partial last block, exactly full blocks), blocks in any order, one and three threads;
    fp32 and bf16 pages (a bf16 server's cache: the same fp32 arithmetic on the bf16 values). The
    positions of a last block past a row's length hold NaN (a freed block's leftovers may be anything):
    none of it reaches the output."""
    from inference_server.paged_kernel import decode_kernel, paged_decode
    fn = decode_kernel(dtype=dtype)
    assert fn is not None, "the C kernel did not build (a C compiler is part of `make setup`)"
    g = torch.Generator().manual_seed(head_dim)
    kv_heads, lens = 2, torch.tensor([1, block_size, block_size + 1, 7 * block_size, 300, 33], dtype=torch.long)
    most = int(-(-lens.max() // block_size))
    kp, vp = (torch.randn(len(lens) * most + 3, kv_heads, block_size, head_dim, generator=g).to(dtype) for _ in range(2))
    table = torch.randperm(kp.shape[0], generator=g)[:len(lens) * most].view(len(lens), most).contiguous()
    for r, n in enumerate(lens.tolist()):
        if n % block_size:
            for p in (kp, vp):
                p[table[r, n // block_size], :, n % block_size:] = float("nan")
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=g).to(dtype)
    want = torch.empty(q.shape)
    for r, n in enumerate(lens.tolist()):
        k, v = (p[table[r]].float().transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :n] for p in (kp, vp))
        want[r] = F.scaled_dot_product_attention(q[r].float().view(kv_heads, group, head_dim), k, v,
                                                 scale=0.1).flatten(0, 1)
    for threads in (1, 3):
        out = torch.full_like(q, float("nan"))
        paged_decode(fn, q, kp, vp, table, lens, out, 0.1, threads)
        assert torch.allclose(out.float(), want.to(dtype).float() if dtype != torch.float32 else want,
                              atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-4 if dtype == torch.float32 else 1e-2), threads


def test_a_partial_rollout_resumed_under_the_same_weights_takes_its_blocks_from_the_prefix_cache(tiny_model):
    """The rollout manager aborts a request mid-response and later sends prompt + partial output as
    a new one. Under the same weights that one takes the full blocks the first computed from the
    prefix cache and computes only the rest: the same greedy tokens and logprobs as a run never
    interrupted. Under new weights nothing is reused (their keys and values would be stale)."""
    prompt = list(range(300, 340))

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.0)
    whole = Sequence("whole", list(prompt), greedy(60))
    run(engine(tiny_model), {0: [whole]})
    e = engine(tiny_model)
    first = Sequence("a", list(prompt), greedy(60))
    run(e, {0: [first]}, {25: lambda e: e.abort("a")})
    done = len(first.output_ids)
    assert first.finish_reason["type"] == "abort" and 16 < done < 60
    before = e.scheduler.cached_tokens
    rest = Sequence("a-resumed", prompt + first.output_ids, greedy(60 - done))
    run(e, {0: [rest]})
    assert e.scheduler.cached_tokens - before == (len(prompt) + done - 1) // 16 * 16
    assert first.output_ids + rest.output_ids == whole.output_ids
    assert max(abs(x - y) for x, y in zip(first.output_logprobs + rest.output_logprobs, whole.output_logprobs)) < 1e-4
    e.set_version(e.version + 1)                                  # new weights (here: the same ones, renamed)
    before = e.scheduler.cached_tokens
    run(e, {0: [Sequence("b", prompt + first.output_ids, greedy(3))]})
    assert e.scheduler.cached_tokens == before
    assert e.scheduler.blocks.num_free == e.scheduler.blocks.num_blocks


def test_the_prefix_cache_keeps_full_blocks_until_needed_and_forgets_them_under_new_weights():
    a = BlockAllocator(6, 4)
    a.set_epoch(0)
    ids = list(range(10))                              # 2 full blocks and 2 tokens
    held = a.alloc(3)
    a.cache(ids, held, 9)                              # positions 0-8 computed: blocks 0 and 1 are full
    a.free(held)
    assert a.num_free == 6 and a.num_cached == 2      # kept, but there for the taking
    got = a.match(ids + [99])
    assert got == held[:2] and a.refs(held[0]) == 1
    assert a.match([0, 1, 2, 3, 7, 7, 7, 7, 1]) == held[:1]      # the second block's tokens differ
    assert a.match([9, 9, 9, 9] + ids[4:9]) == []                  # the same second block after another first
    assert a.match(ids[:4]) == []                                  # the last token is always computed
    a.free(got)
    a.free(held[:1])
    assert a.num_free == 6
    x = a.alloc(5)                                     # 4 free, then the least recently used cached one
    assert a.num_cached == 1 and a.match(ids) == held[:1]
    a.free(x + held[:1])
    a.set_epoch(1)
    assert a.num_cached == 0 and a.num_free == 6 and a.match(ids) == []
    a.set_epoch(None)                                  # weights torn: nothing is cached
    y = a.alloc(3)
    a.cache(ids, y, 9)
    a.free(y)
    assert a.num_cached == 0
