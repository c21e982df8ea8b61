"""The rollout manager on real servers on loopback with a tiny model."""
import asyncio
import json
import math
import os
import signal

import pytest
import httpx
from transformers import AutoTokenizer

from rollout.client import ServerClient
from rollout.config import RolloutConfig
from rollout.data import PromptSource
from rollout.filters import keep_all
from rollout.manager import RolloutManager
from rollout.rewards import format_check, math_answer
from rollout.router import Router
from rollout.types import Sample, SampleStatus
from trainer_bridge.batch import Batch
from tests.conftest import start_server

PROMPTS = [{"prompt": f"{i} + {i} =", "answer": 2 * i} for i in range(200)]


async def first_token_parity(sample):
    """Varies within a group, so groups pass the all-equal filter."""
    return float(sample.response_ids[0] % 2)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    started = []

    def make(n=1):
        while len(started) < n:
            started.append(start_server(tiny_model, tmp_path_factory))
        return started[:n]
    yield make
    for s in started:
        s.stop()


def manager(urls, tokenizer, reward=first_token_parity, data=None, group_filter=None, **cfg):
    cfg = RolloutConfig(**{"group_size": 4, "batch_size": 2, "max_new_tokens": 16, "ignore_eos": True, **cfg})
    router = Router([ServerClient(u, timeout_s=120) for u in urls])
    extra = {"group_filter": group_filter} if group_filter is not None else {}
    return RolloutManager(cfg, router, data or PromptSource(PROMPTS, seed=0), tokenizer, reward, **extra)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=240))


def test_groups_of_n_make_a_padded_batch(servers, tokenizer):
    async def main():
        m = manager([servers()[0].url], tokenizer)
        await m.start()
        groups, metrics = await m.next_batch()
        await m.stop()
        return groups, metrics
    groups, metrics = run(main())
    assert len(groups) == 2 and all(len(g.samples) == 4 for g in groups)
    for g in groups:
        assert len({tuple(s.prompt_ids) for s in g.samples}) == 1
        for s in g.samples:
            assert s.status is SampleStatus.TRUNCATED and len(s.response_ids) == 16
            assert len(s.logprobs) == len(s.versions) == len(s.loss_mask) == 16
    batch = Batch.from_groups(groups, tokenizer.pad_token_id)
    assert batch.input_ids.shape[0] == 8 and int(batch.loss_mask.sum()) == 8 * 16
    assert batch.group_index.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert (batch.behaviour_logprobs[batch.loss_mask == 0] == 0).all() and (batch.behaviour_logprobs[batch.loss_mask == 1] < 0).all()
    assert metrics["samples_per_s"] > 0 and metrics["staleness_max"] == 0


def test_oversampling_fills_a_batch_while_slow_groups_keep_running(servers, tokenizer):
    slow = {i for i in range(200) if i % 2 == 0}

    async def slow_or_fast(sample, ctx):
        n = 400 if sample.metadata["item"] in slow else 4
        await ctx.generate(sample, max_new_tokens=n)
        return sample

    async def main():
        m = manager([servers()[0].url], tokenizer, data=PromptSource(PROMPTS, shuffle=False),
                    batch_size=2, oversample=3.0, max_staleness=4)
        m.rollout_fn = slow_or_fast
        await m.start()
        groups, _ = await m.next_batch()
        still_running = [g.data_index for g in m.running.values()]
        await m.stop()
        return groups, still_running
    groups, still_running = run(main())
    assert all(g.data_index % 2 == 1 for g in groups), "the fast groups fill the batch"
    assert any(i % 2 == 0 for i in still_running), "the slow groups are still generating"


def test_on_policy_warmup_generates_only_the_batch_in_hand_until_its_last_version(servers, tokenizer):
    """rollout.on_policy_warmup=2: versions 0 and 1 generate as sync mode does (nothing starts
    ahead of the batch the trainer holds, so every sample is sampled by the weights it trains);
    from version 2 on the manager oversamples and runs ahead up to max_staleness."""
    async def main():
        m = manager([servers()[0].url], tokenizer, batch_size=2, oversample=3.0, max_staleness=4,
                    on_policy_warmup=2)
        await m.start()
        seen = []
        for version in (1, 2):
            await m.next_batch()
            await asyncio.sleep(1.0)                  # time to start groups ahead, if it would
            seen.append(len(m.running) + len(m.ready))
            await m.on_weights_updated(version)
        await asyncio.sleep(1.0)
        seen.append(len(m.running) + len(m.ready))
        await m.stop()
        return seen
    ahead0, ahead1, after = run(main())
    assert ahead0 == 0 and ahead1 == 0               # nothing started ahead during the warm-up
    assert after > 2                                 # then oversampling: more than one batch in progress


def test_a_version_published_on_policy_holds_the_manager_to_the_batch_in_hand(servers, tokenizer):
    """rollout.on_policy_warmup_kl's lever: the trainer publishes version 1 with on_policy=True
    (its last update was large), so nothing starts ahead while version 1 generates; version 2 is
    published without it and the manager runs ahead again."""
    async def main():
        m = manager([servers()[0].url], tokenizer, batch_size=2, oversample=3.0, max_staleness=4,
                    on_policy_warmup=1)
        await m.start()
        seen = []
        for version, on_policy in ((1, True), (2, False)):
            await m.next_batch()
            await m.on_weights_updated(version, on_policy=on_policy)
            await asyncio.sleep(1.0)                  # time to start groups ahead, if it would
            seen.append(len(m.running) + len(m.ready) - 2)       # beyond the next batch
        await m.stop()
        return seen
    held, after = run(main())
    assert held <= 0 and after > 0


def test_new_weight_version_aborts_and_resumes_in_flight_samples(servers, tokenizer, tiny_model_v2):
    from transformers import AutoModelForCausalLM

    from weight_sync.sender import WeightSync
    url = servers()[0].url
    new = AutoModelForCausalLM.from_pretrained(tiny_model_v2)
    version = int(__import__("httpx").get(f"{url}/get_weight_version").json()["weight_version"]) + 1

    async def main():
        # keep_all: a group whose 4 first tokens share a parity (1 in 8) would be dropped by the
        # all-equal filter and replaced by a fresh one; with both dropped no aborted sample is left
        m = manager([url], tokenizer, max_new_tokens=1000, update_policy="abort_all", max_staleness=2,
                    batch_size=2, oversample=1.0, group_filter=keep_all)
        client = m.router.clients[0]
        tokens0 = (await client.get("/get_server_info"))["stats"]["generation_tokens"]
        await m.start()
        # every request decoding on the server (not still on its way there), with tokens to resume
        while len(m.inflight) < 8 or (info := await client.get("/get_server_info"))["num_running"] < 8 or \
                info["stats"]["generation_tokens"] < tokens0 + 8 * 4:
            await asyncio.sleep(0.01)
        # hold the requests where they are (KV kept) while the push runs, so none can finish its
        # 1000 tokens before the new version lands, however slow the push is on a busy machine
        await client._post("/pause_generation", {"mode": "in_place"})
        sync = WeightSync([url], bucket_bytes=1 << 20)
        await asyncio.to_thread(sync.push, new, version)
        sync.close()
        aborted0 = (await client.get("/get_server_info"))["stats"]["aborted_requests"]
        inflight = len(m.inflight)
        await m.on_weights_updated(version, wait=True)
        aborted = (await client.get("/get_server_info"))["stats"]["aborted_requests"] - aborted0
        await client._post("/continue_generation", {})
        groups, metrics = await m.next_batch()
        await m.stop()
        return groups, metrics, f"{inflight} requests in flight at the update, {aborted} aborted on the server"
    groups, metrics, seen = run(main())
    samples = [s for g in groups for s in g.samples]
    resumed = [s for s in samples if s.num_aborts > 0]
    assert resumed, f"no resumed sample in the batch: {seen}; {[(s.group_id, s.num_aborts) for s in samples]}"
    assert metrics["tokens_aborted"] > 0 and metrics["tokens_resumed"] > 0
    # a request still in its prefill at the pause (a busy machine splits prefills) has no old tokens
    assert any(set(s.versions) == {version - 1, version} for s in resumed)
    for s in resumed:
        assert set(s.versions) <= {version - 1, version} and version in s.versions
        assert s.versions == sorted(s.versions)
        assert len(s.logprobs) == len(s.response_ids) == len(s.versions) == 1000


async def two_ready_groups_at_bound_0(url, tokenizer):
    """A stopped manager (bound 0, stale samples dropped) holding the first two finished groups."""
    m = manager([url], tokenizer, max_staleness=0, batch_size=2, oversample=1.0, stale_policy="drop")
    await m.start()
    while len(m.ready) < 2:
        await asyncio.sleep(0.05)
    await m.stop()
    return m


def test_staleness_bound_at_consumption(servers, tokenizer):
    async def main():
        m = await two_ready_groups_at_bound_0(servers()[0].url, tokenizer)
        # the trainer moves on, but these samples were made by the weights before: too stale for bound 0
        m.trainer_version = max(s.versions[-1] for g in m.ready for s in g.samples) + 1
        with pytest.raises(RuntimeError, match="stopped"):
            await m.next_batch()
        return m
    m = run(main())
    assert not m.ready and m.metrics.drops["stale"] >= 2 and m.metrics.stale_dropped >= 8
    lengths = m.metrics.lengths.snapshot()
    assert sum(b["dropped_stale"] for b in lengths["by_length"].values()) >= 8
    assert_lengths_add_up(lengths)


def test_a_batch_taken_while_its_version_is_pushed_is_judged_against_that_version(servers, tokenizer):
    """weight_sync.overlap: the trainer takes batch v+1 while version v+1 still streams. Asked
    as_of=v+1, the manager holds the groups to v+1's bound already: those that would be too old
    once it lands are not handed out; as of the version it serves they would be."""
    async def main():
        m = await two_ready_groups_at_bound_0(servers()[0].url, tokenizer)
        v = max(s.versions[-1] for g in m.ready for s in g.samples)
        m.trainer_version = v
        assert m.batch_ready() and len(m.ready) == 2              # fresh for version v
        with pytest.raises(ValueError, match="as_of=.*version"):
            m.batch_ready(as_of=v + 2)                              # two versions ahead: a caller's bug
        assert not m.batch_ready(as_of=v + 1)                      # too old for v + 1: dropped
        return m
    m = run(main())
    assert not m.ready and m.metrics.drops["stale"] >= 2


async def long_every_third(sample, ctx):
    """Sample 0 of every third prompt runs 400 tokens, the rest 8: a long tail that spans versions."""
    n = 400 if sample.index == 0 and int(sample.group_id[1:]) % 3 == 0 else 8
    if n > sample.num_generated:
        await ctx.generate(sample, max_new_tokens=n - sample.num_generated)
    return sample


@pytest.mark.parametrize("policy", ["drop", "wait"])
def test_wait_paces_instead_of_dropping_long_samples(servers, tokenizer, hf_model, policy):
    """A trainer that pushes a new version after every batch (real pushes), bound 1, and a long
    sample in every third group. drop throws the long ones away as stale; wait trains every one of
    them within the bound: the trainer waits for the at-risk groups instead."""
    import httpx

    from weight_sync.sender import WeightSync
    url = servers()[0].url

    async def main():
        m = manager([url], tokenizer, reward=zero, max_staleness=1, batch_size=2, oversample=2.0,
                    stale_policy=policy)
        m.rollout_fn, m.group_filter = long_every_third, keep_all
        version = int(httpx.get(f"{url}/get_weight_version").json()["weight_version"])
        m.trainer_version = version
        sync = WeightSync([url], bucket_bytes=1 << 20)
        trained = []
        await m.start()
        try:
            for _ in range(12):
                groups, metrics = await m.next_batch()
                trained += [s for g in groups for s in g.samples]
                assert metrics["staleness_max"] <= 1
                version += 1
                await asyncio.to_thread(sync.push, hf_model, version)
                await m.on_weights_updated(version)
        finally:
            await m.stop()
            await m.router.close()
            sync.close()
        return m, trained
    m, trained = run(main())
    lengths = m.metrics.lengths.snapshot()
    assert_lengths_add_up(lengths)
    long_trained = sum(len(s.response_ids) == 400 for s in trained)
    if policy == "drop":
        assert m.metrics.drops["stale"] >= 1 and m.metrics.stale_dropped >= 4, m.metrics.drops
        return
    assert not m.metrics.drops["stale"] and m.metrics.stale_dropped == 0 and m.metrics.requests_doomed == 0
    assert sum(r["dropped_stale"] for r in lengths["by_length"].values()) == 0
    assert long_trained >= 3 and m.metrics.waits_for_old >= 1, (long_trained, m.metrics.waits_for_old)


async def zero(sample):
    return 0.0


@pytest.mark.parametrize("policy", ["keep", "drop"])
def test_keep_trains_a_sample_past_the_bound_with_only_its_too_old_tokens_masked(servers, tokenizer, policy):
    """stale_policy keep: a group whose samples span versions v and v+1, consumed with the trainer at
    v+2 (bound 0, max_token_age 1), is trained, not dropped: its v tokens are masked (loss_mask 0),
    its v+1 tokens are kept. With drop, the same group is dropped as stale."""
    async def main():
        m = manager([servers()[0].url], tokenizer, max_staleness=0, batch_size=2, oversample=1.0,
                    stale_policy=policy, max_token_age=1)
        await m.start()
        while len(m.ready) < 2:
            await asyncio.sleep(0.05)
        await m.stop()
        v = max(s.versions[-1] for g in m.ready for s in g.samples)
        for g in m.ready:                     # the second half of each response came after an update
            for s in g.samples:
                half = len(s.versions) // 2
                s.versions[half:] = [v + 1] * (len(s.versions) - half)
        m.trainer_version = v + 2
        m.stopping = False
        try:
            groups, metrics = await asyncio.wait_for(m.next_batch(), 5)
        except (RuntimeError, asyncio.TimeoutError):
            groups, metrics = [], {}
        return m, groups, metrics, v
    m, groups, metrics, v = run(main())
    if policy == "drop":
        assert not groups and m.metrics.drops["stale"] >= 2
        return
    assert len(groups) == 2 and not m.metrics.drops["stale"]
    masked = 0
    for s in (s for g in groups for s in g.samples):
        for version, keep in zip(s.versions, s.loss_mask):
            assert keep == (0 if version == v else 1)
        masked += s.versions.count(v)
    assert metrics["tokens_masked_old"] == masked > 0


def assert_lengths_add_up(snapshot: dict) -> None:
    """generated = trained + dropped + pending, in samples and in tokens, in every length bucket."""
    for table in (snapshot["by_length"], snapshot["tokens_by_length"]):
        for bucket, row in table.items():
            out = row["trained"] + row["dropped_stale"] + row["dropped_filtered"] + row["dropped_failed"] + row["pending"]
            assert row["generated"] == out, (bucket, row)


def test_staleness_bound_at_admission(servers, tokenizer, tiny_model):
    import httpx
    url = servers()[0].url
    old = int(httpx.get(f"{url}/get_weight_version").json()["weight_version"])
    # the server moves two versions on (same weights, new version): the partial tokens are now 2 behind
    r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": tiny_model, "weight_version": old + 2})
    assert r.status_code == 200, r.text

    async def main():
        m = manager([url], tokenizer, max_staleness=1, batch_size=1, stale_policy="drop")
        partial = [Sample("g-old", i, [5, 6, 7], label=0, response_ids=[9, 9], logprobs=[-1.0, -1.0],
                          versions=[old, old], loss_mask=[1, 1], status=SampleStatus.PARTIAL) for i in range(4)]
        state = {"trainer_version": old + 2, "consumed_groups": 2, "data": m.data.state_dict(), "metrics": {},
                 "groups": [{"group_id": "g-old", "data_index": -1, "samples": [s.to_dict() for s in partial]}]}
        m.load_state_dict(json.loads(json.dumps(state)))
        await m.start()
        groups, metrics = await m.next_batch()
        await m.stop()
        return groups, metrics
    groups, metrics = run(main())
    assert metrics["drops"].get("stale") == 1 and metrics["stale_dropped"] >= 1
    assert all(g.group_id != "g-old" for g in groups)


def test_groups_past_the_bound_stop_generating_at_once(servers, tokenizer, tiny_model):
    """A version lands that puts running groups past max_staleness: their requests are aborted
    then, not generated to the end and thrown away, and the groups count as stale drops."""
    import httpx
    url = servers()[0].url
    old = int(httpx.get(f"{url}/get_weight_version").json()["weight_version"])

    async def main():
        m = manager([url], tokenizer, max_new_tokens=1000, max_staleness=1, update_policy="continue",
                    batch_size=1, oversample=2.0, stale_policy="drop")
        m.trainer_version = old
        m.on_drop = lambda group, reason: dropped.append(group)
        await m.start()
        while len(m.inflight) < 8:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)                # every request has some tokens at version `old`
        r = await asyncio.to_thread(httpx.post, f"{url}/update_weights_from_disk",
                                    json={"model_path": tiny_model, "weight_version": old + 2}, timeout=60)
        assert r.status_code == 200, r.text
        await m.on_weights_updated(old + 2, wait=True)
        while m.metrics.drops["stale"] < 2:
            await asyncio.sleep(0.01)
        await m.stop()
        return m
    dropped = []
    m = run(main())
    assert m.metrics.requests_doomed >= 8
    # the 8 doomed samples stopped short of their 1000-token budget when the version landed (how far
    # short depends on how long the reload took: about half way on a loaded CI machine)
    lengths = [len(s.response_ids) for g in dropped for s in g.samples]
    assert len(lengths) >= 8 and max(lengths) < 1000, lengths
    assert m.metrics.tokens_wasted < 2 * 4 * 1000
    assert m.metrics.tokens_resumed == 0         # nothing of theirs was resumed


def test_abort_furthest_aborts_only_while_rollout_is_a_batch_ahead(servers, tokenizer, tiny_model):
    """A new version aborts nothing while the trainer will still wait on the requests in flight
    (their re-prefill would only lengthen its wait); once the next two batches are ready, it aborts
    the abort_fraction of them with the most tokens left, and those resume."""
    import httpx
    url = servers()[0].url
    old = int(httpx.get(f"{url}/get_weight_version").json()["weight_version"])

    def aborted() -> int:
        return int(httpx.get(f"{url}/get_server_info").json()["stats"]["aborted_requests"])

    async def two_short(sample, ctx):              # items 0 and 1 finish first
        budget = 400 if sample.metadata["item"] < 2 else 1000
        await ctx.generate(sample, max_new_tokens=budget - len(sample.response_ids))
        return sample

    async def new_version(m, v):
        r = await asyncio.to_thread(httpx.post, f"{url}/update_weights_from_disk",
                                    json={"model_path": tiny_model, "weight_version": v}, timeout=60)
        assert r.status_code == 200, r.text
        inflight = len(m.inflight)                     # what the policy sees: no await in between
        await m.on_weights_updated(v, wait=True)
        return inflight

    async def main():
        m = manager([url], tokenizer, data=PromptSource(PROMPTS, shuffle=False), batch_size=1, oversample=4.0,
                    max_new_tokens=1000, max_staleness=4, update_policy="abort_furthest", abort_fraction=0.5)
        m.rollout_fn = two_short
        m.trainer_version = old
        await m.start()
        while len(m.inflight) < 16:
            await asyncio.sleep(0.01)
        a0 = await asyncio.to_thread(aborted)
        await new_version(m, old + 1)                  # nothing ready yet
        before = (await asyncio.to_thread(aborted)) - a0, m.metrics.tokens_aborted
        while len(m.ready) < 2:                        # two batches' worth (batch_size 1)
            await asyncio.sleep(0.01)
        a1 = await asyncio.to_thread(aborted)
        inflight = await new_version(m, old + 2)       # the long groups' requests
        after = (await asyncio.to_thread(aborted)) - a1
        while sum(s.num_aborts for g in m.running.values() for s in g.samples) < after:
            await asyncio.sleep(0.01)
        resumed = sum(1 for g in m.running.values() for s in g.samples if s.num_aborts)
        await m.stop()
        return before, inflight, after, resumed
    before, inflight, after, resumed = run(main())
    assert before == (0, 0)
    assert 0 < inflight <= 8 and after == math.ceil(inflight * 0.5) and resumed == after


def test_a_config_the_server_refuses_stops_the_run_with_its_reason(servers, tokenizer):
    async def main():
        m = manager([servers()[0].url], tokenizer, max_new_tokens=5000)   # the server's context is 1024
        await m.start()
        with pytest.raises(RuntimeError, match="max_new_tokens.*5000.*context length 1024"):
            await m.next_batch()
        await m.stop()
        return m.state_dict()
    state = run(main())
    # nothing churned through the data: the groups that were started are kept, none failed
    assert state["groups"] and len(state["groups"]) == state["data"]["cursor"] and not state["metrics"]["drops"]
    assert all(s["status"] == "pending" for g in state["groups"] for s in g["samples"])


def test_request_slots_go_to_the_oldest_sample_first():
    from rollout.slots import RequestSlots

    async def main():
        slots, order = RequestSlots(1), []
        await slots.acquire((0,))

        async def want(key):
            async with slots.take(key):
                order.append(key)
        tasks = [asyncio.create_task(want(k)) for k in [(7,), (3,), (5,), (3,)]]
        await asyncio.sleep(0.01)
        slots.release()
        await asyncio.gather(*tasks)
        return order, slots.free
    order, free = run(main())
    assert order == [(3,), (3,), (5,), (7,)] and free == 1


def test_multi_turn_function_with_a_toy_tool(servers, tokenizer):
    tool_ids = tokenizer("<tool>42</tool>", add_special_tokens=False).input_ids

    async def with_tool(sample, ctx):
        await ctx.generate(sample, max_new_tokens=5)
        sample.append_environment(tool_ids)           # the tool's answer: context, not trained on
        await ctx.generate(sample, max_new_tokens=7)
        return sample

    def episodes_ended(url):
        text = httpx.get(f"{url}/metrics", timeout=10).text
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith("riptide_episodes_ended")))

    async def main():
        m = manager([servers()[0].url], tokenizer, kv_policy="continue")   # the field goes over the wire too
        m.rollout_fn = with_tool
        await m.start()
        groups, _ = await m.next_batch()
        await m.stop()
        return groups
    before = episodes_ended(servers()[0].url)
    groups = run(main())
    # each finished episode told its server it was over (its KV blocks first in line for eviction)
    assert episodes_ended(servers()[0].url) - before >= sum(len(g.samples) for g in groups)
    want = [1] * 5 + [0] * len(tool_ids) + [1] * 7
    for s in (s for g in groups for s in g.samples):
        assert s.loss_mask == want and s.response_ids[5:5 + len(tool_ids)] == tool_ids
        assert s.versions[5:5 + len(tool_ids)] == [-1] * len(tool_ids)
    batch = Batch.from_groups(groups, tokenizer.pad_token_id)
    p = len(groups[0].samples[0].prompt_ids)
    assert batch.loss_mask[0, p:p + len(want)].tolist() == want


def test_killing_one_of_two_servers_loses_no_sample(tiny_model, tokenizer, tmp_path_factory):
    a, b = start_server(tiny_model, tmp_path_factory), start_server(tiny_model, tmp_path_factory)
    try:
        async def main():
            m = manager([a.url, b.url], tokenizer, max_new_tokens=300, batch_size=2, oversample=2.0,
                        max_staleness=8)
            await m.start()
            while m.router.inflight[a.url] < 4:
                await asyncio.sleep(0.05)
            os.kill(a.proc.pid, signal.SIGKILL)
            batches = [await m.next_batch() for _ in range(3)]
            await m.stop()
            return m, batches
        m, batches = run(main())
    finally:
        a.stop()
        b.stop()
    samples = [s for groups, _ in batches for g in groups for s in g.samples]
    assert len(samples) == 3 * 2 * 4 and len({s.uid for s in samples}) == len(samples)
    assert all(s.status is SampleStatus.TRUNCATED and len(s.response_ids) == 300 for s in samples)
    assert all(len(s.logprobs) == 300 for s in samples)
    assert m.metrics.retries > 0 and any(s.num_retries for s in samples)
    indices = [g.data_index for groups, _ in batches for g in groups]
    assert len(indices) == len(set(indices))


def test_save_restart_load_repeats_no_prompt(servers, tokenizer, tmp_path):
    url = servers()[0].url

    async def odd_prompts_run_long(sample, ctx):
        budget = (600 if sample.metadata["item"] % 2 else 8) - sample.num_generated
        await ctx.generate(sample, max_new_tokens=budget)
        return sample

    def make():
        m = manager([url], tokenizer, max_new_tokens=600, oversample=3.0, max_staleness=4,
                    data=PromptSource(PROMPTS, shuffle=False))
        m.rollout_fn = odd_prompts_run_long
        m.group_filter = keep_all          # every group reaches a batch: the test can account for all
        return m

    async def first_run():
        m = make()
        await m.start()
        groups, _ = await m.next_batch()
        await m.stop()
        state = m.state_dict()
        (tmp_path / "rollout.json").write_text(json.dumps(state))
        return [g.data_index for g in groups], state

    async def second_run():
        m = make()
        m.load_state_dict(json.loads((tmp_path / "rollout.json").read_text()))
        await m.start()
        batches = [await m.next_batch() for _ in range(3)]
        await m.stop()
        return [g.data_index for groups, _ in batches for g in groups], m.state_dict()

    seen, state = run(first_run())
    pending = [g["data_index"] for g in state["groups"]]
    partial = [g for g in state["groups"] if any(s["status"] == "partial" for s in g["samples"])]
    assert pending and partial, "stopping mid-run keeps unfinished groups with their partial tokens"
    later, later_state = run(second_run())
    everything = seen + later + [g["data_index"] for g in later_state["groups"]]
    assert len(everything) == len(set(everything)), "no prompt repeated"
    assert set(pending) <= set(everything), "no prompt lost"
    cursor = state["data"]["cursor"]
    assert all(i >= cursor for i in set(later) - set(pending)), "new prompts come after the saved position"


def test_a_failing_reward_marks_the_sample_failed_and_the_run_goes_on(servers, tokenizer):
    calls = {"n": 0}

    async def flaky(sample):
        calls["n"] += 1
        if sample.metadata["item"] % 3 == 0:
            raise ZeroDivisionError("the user's reward function broke")
        return float(sample.response_ids[0] % 2)

    async def main():
        m = manager([servers()[0].url], tokenizer, reward=flaky, data=PromptSource(PROMPTS, shuffle=False))
        await m.start()
        groups, _ = await m.next_batch()
        while not m.metrics.drops["failed"]:      # item 0's group may finish after the batch is full
            await asyncio.sleep(0.01)
        more, _ = await m.next_batch()            # and the run goes on
        await m.stop()
        return groups + more, m.metrics
    groups, metrics = run(main())
    assert metrics.drops["failed"] >= 1 and len(groups) == 4
    assert all(g.data_index % 3 != 0 for g in groups)


def test_builtin_rewards_and_config_errors():
    s = Sample("g", 0, [1], label="#### 1,234")
    s.response_text = "so the total is 1234."
    assert asyncio.run(math_answer(s)) == 1.0
    s.response_text = "\\boxed{12}"
    assert asyncio.run(math_answer(s)) == 0.0 and asyncio.run(format_check(s)) == 1.0
    with pytest.raises(ValueError, match="rollout.oversample"):
        RolloutConfig(oversample=0.5).validate()
    with pytest.raises(ValueError, match="update_policy"):
        RolloutConfig(update_policy="sometimes").validate()
    # values that would make the manager churn through the data without a word
    for field, value in [("request_timeout_s", 0), ("max_request_retries", -1), ("progress_timeout_s", 0),
                         ("max_failed_groups", 0), ("max_group_retries", -1), ("top_k", 0)]:
        with pytest.raises(ValueError, match=f"rollout.{field}={value}"):
            RolloutConfig(**{field: value}).validate()


def test_filter_patience_keeps_groups_when_every_group_lacks_signal(servers, tokenizer):
    async def constant(sample):
        return 1.0                      # every group all-equal: the filter alone would starve the batch

    async def main():
        m = manager([servers()[0].url], tokenizer, reward=constant, filter_patience=3, max_staleness=8)
        await m.start()
        groups, metrics = await m.next_batch()
        await m.stop()
        return groups, metrics
    groups, metrics = run(main())
    assert len(groups) == 2 and metrics["drops"]["all_equal_rewards"] >= 3
    assert metrics["kept_past_patience"] >= 2
    assert sum(b["dropped_filtered"] for b in metrics["by_length"].values()) >= 3 * 4
    assert sum(b["trained"] for b in metrics["by_length"].values()) == 2 * 4
    assert_lengths_add_up(metrics)


def test_the_reward_of_groups_the_filter_drops_still_counts_in_the_policys_reward(servers, tokenizer):
    """A prompt the policy solves (every sample 1) leaves the trained batch under all_equal, so the
    batch's reward understates the policy's: scored_reward_mean counts every scored group."""
    async def solved_or_parity(sample):
        return 1.0 if sample.label % 4 == 0 else float(sample.response_ids[0] % 2)

    async def main():
        m = manager([servers()[0].url], tokenizer, reward=solved_or_parity, max_staleness=8)
        await m.start()
        out = [await m.next_batch() for _ in range(3)]
        await m.stop()
        return out
    scored = trained = 0.0
    for groups, metrics in run(main()):
        assert metrics["reward_mean"] == pytest.approx(sum(s.reward for g in groups for s in g.samples) / 8)
        assert 0 <= metrics["scored_reward_mean"] <= 1 and metrics["samples_scored_since"] % 4 == 0
        scored += metrics["scored_reward_mean"] * metrics["samples_scored_since"]
        trained += metrics["reward_mean"]
    total = metrics["samples_scored"]
    assert metrics["drops"].get("all_equal_rewards", 0) >= 1            # solved prompts were filtered out
    assert scored == pytest.approx(metrics["reward_scored"]) and total >= 3 * 8
    assert metrics["reward_scored"] / total > trained / 3             # the batches understate the policy


def test_the_length_ledger_shows_which_lengths_are_dropped():
    """Long samples dropped as stale pull length_bias below 1; every sample is accounted for."""
    from rollout.metrics import LengthLedger
    from rollout.types import Sample
    ledger = LengthLedger()
    samples = []
    for i, n in enumerate([10, 10, 100, 100, 1000, 1000]):
        s = Sample("g", i, [1, 2], "p", "a")
        s.append_generated(list(range(n)), [0.0] * n, [0] * n)
        samples.append(s)
        ledger.finished(s)
    for s in samples[:4]:
        ledger.trained(s)
    ledger.dropped(samples[4], "stale")
    ledger.dropped(samples[4], "stale")            # once only
    snap = ledger.snapshot()
    assert snap["generated_mean_len"] == 370 and snap["trained_mean_len"] == 55
    assert abs(snap["length_bias"] - 55 / 370) < 1e-9
    assert snap["by_length"]["<=1024"] == {"generated": 2, "trained": 0, "dropped_stale": 1, "dropped_filtered": 0,
                                           "dropped_failed": 0, "pending": 1}
    assert snap["tokens_by_length"]["<=16"]["trained"] == 20
    assert_lengths_add_up(snap)


def frozen(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_frozen_server_is_marked_down_and_its_requests_move(tiny_model, tokenizer, tmp_path_factory):
    """SIGSTOP one of two servers mid-rollout: within seconds it is marked down, its requests resume
    on the other from the tokens their samples hold, batches keep coming; awake, it is back."""
    a, b = start_server(tiny_model, tmp_path_factory), start_server(tiny_model, tmp_path_factory)
    try:
        async def main():
            m = manager([a.url, b.url], tokenizer, max_new_tokens=300, batch_size=2, oversample=2.0,
                        max_staleness=8, progress_timeout_s=3)
            await m.start()
            while m.router.inflight[a.url] < 4:
                await asyncio.sleep(0.05)
            os.kill(a.proc.pid, signal.SIGSTOP)
            try:
                batches = [await asyncio.wait_for(m.next_batch(), 120) for _ in range(3)]
                down = dict(m.router.down)
            finally:
                os.kill(a.proc.pid, signal.SIGCONT)
            for _ in range(300):                          # awake: the router takes it back
                if a.url not in m.router.down:
                    break
                await asyncio.sleep(0.1)
            back = a.url not in m.router.down
            await m.stop()
            return m, batches, down, back
        m, batches, down, back = run(main())
    finally:
        a.stop()
        b.stop()
    assert a.url in down and b.url not in down and back
    samples = [s for groups, _ in batches for g in groups for s in g.samples]
    assert len(samples) == 3 * 2 * 4 and len({s.uid for s in samples}) == len(samples)
    assert all(len(s.response_ids) == len(s.logprobs) == 300 for s in samples)
    assert m.metrics.retries > 0 and not m.metrics.drops["failed"] and not m.metrics.groups_failed


def test_failing_requests_stop_the_manager_instead_of_burning_prompts(servers, tokenizer):
    """Every request fails (a read timeout far too short for any answer): the manager retries the
    groups a bounded number of times, then stops with the underlying error; every prompt it drew is
    accounted for, and the data is not churned through."""
    url = servers()[0].url

    async def main():
        cfg = RolloutConfig(group_size=4, batch_size=2, max_new_tokens=16, ignore_eos=True, max_request_retries=1)
        m = RolloutManager(cfg, Router([ServerClient(url, timeout_s=0.001)]), PromptSource(PROMPTS, seed=0),
                           tokenizer, first_token_parity)
        await m.start()
        with pytest.raises(RuntimeError, match="groups in a row failed.*timed out"):
            await asyncio.wait_for(m.next_batch(), 60)
        await m.stop()
        return m.state_dict()
    state = run(main())
    drawn = state["data"]["cursor"]
    kept = len(state["groups"]) + state["metrics"]["drops"].get("failed", 0)
    assert drawn == kept, "every prompt drawn is either kept for a resume or counted as failed"
    assert drawn <= 2 * RolloutConfig().max_failed_groups
    assert state["metrics"]["groups_failed"] >= RolloutConfig().max_failed_groups


def test_stop_does_not_wait_on_a_hung_server(tiny_model, tokenizer, tmp_path_factory):
    """stop() (what a checkpoint calls) with the only server frozen: it returns after
    progress_timeout_s, not request_timeout_s, and keeps every started group for a resume."""
    srv = start_server(tiny_model, tmp_path_factory)
    try:
        async def main():
            m = manager([srv.url], tokenizer, max_new_tokens=600, progress_timeout_s=3, request_timeout_s=600)
            await m.start()
            while m.router.inflight[srv.url] < 4:
                await asyncio.sleep(0.05)
            os.kill(srv.proc.pid, signal.SIGSTOP)
            while not frozen(srv.proc.pid):
                await asyncio.sleep(0.01)
            await asyncio.wait_for(m.stop(), 30)
            return m.state_dict()
        state = run(main())
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
        srv.stop()
    assert state["groups"] and len(state["groups"]) == state["data"]["cursor"]
    assert all(s["status"] in ("pending", "partial") for g in state["groups"] for s in g["samples"])


CPU_CGROUP = "/sys/fs/cgroup/cpu"


def throttled(pid: int, quota_us: int, period_us: int = 1_000_000):
    """Cap a process's CPU with a cgroup v1 `cpu` group of its own (quota per period); a context
    manager that moves it back to the root group and removes the group."""
    import contextlib
    import uuid
    path = f"{CPU_CGROUP}/riptide-test-{uuid.uuid4().hex[:8]}"

    @contextlib.contextmanager
    def cap():
        os.mkdir(path)
        try:
            with open(f"{path}/cpu.cfs_period_us", "w") as f:
                f.write(str(period_us))
            with open(f"{path}/cpu.cfs_quota_us", "w") as f:
                f.write(str(quota_us))
            with open(f"{path}/cgroup.procs", "w") as f:
                f.write(str(pid))
            yield
        finally:
            with contextlib.suppress(OSError), open(f"{CPU_CGROUP}/cgroup.procs", "w") as f:
                f.write(str(pid))
            os.rmdir(path)
    return cap()


def cpu_cgroup_refused() -> str | None:
    if os.geteuid() != 0 or not os.path.exists(f"{CPU_CGROUP}/cpu.cfs_quota_us"):
        return f"needs root and a cgroup v1 cpu controller at {CPU_CGROUP} to slow a server down"
    return None


@pytest.mark.skipif(cpu_cgroup_refused() is not None, reason=cpu_cgroup_refused() or "")
def test_a_slow_server_that_steps_keeps_its_requests(tmp_path_factory):
    """One of two servers gets 10% of a core, as when a trainer shares its cores: its prefills of
    long prompts take seconds while it answers probes. It is not marked down, no request moves and
    no token is wasted; a frozen server is still marked down within seconds
    (test_a_frozen_server_is_marked_down_and_its_requests_move). progress_timeout_s is 4 s here: the
    quota (100 ms of every second) can freeze the server for 900 ms at a time, and with 2 s a probe
    that met two such freezes could go unanswered (at 50 ms a second the router marked the server
    down in a CI run)."""
    import httpx

    from inference_server.tiny_model import build_tiny_model
    model = str(build_tiny_model(tmp_path_factory.mktemp("slow"), hidden=256, layers=4, heads=4, kv_heads=2,
                                 vocab=2000, max_positions=2048, seed=0))
    tokenizer = AutoTokenizer.from_pretrained(model)
    long_prompt = tokenizer.decode(tokenizer(" ".join(str(i % 97) for i in range(2000))).input_ids[:900])
    data = PromptSource([{"prompt": f"{i} {long_prompt}", "answer": i} for i in range(50)], seed=0)
    a, b = start_server(model, tmp_path_factory), start_server(model, tmp_path_factory)
    try:
        async def main():
            m = manager([a.url, b.url], tokenizer, data=data, max_new_tokens=24, batch_size=2, oversample=1.0,
                        max_staleness=8, progress_timeout_s=4)
            m.group_filter = keep_all          # every token generated is trained: none counts as wasted by a filter
            with throttled(a.proc.pid, quota_us=100_000):
                await m.start()
                batches = [await asyncio.wait_for(m.next_batch(), 120) for _ in range(2)]
                stats = httpx.get(f"{a.url}/get_server_info", timeout=30).json()["stats"]
            await m.stop()
            return m, batches, stats
        m, batches, stats = run(main())
    finally:
        a.stop()
        b.stop()
    print(f"throttled server: {stats['steps']} steps, {stats['prompt_tokens']} prompt tokens in "
          f"{stats['busy_seconds']:.1f} s busy")
    assert stats["prompt_tokens"] > 0, "the slow server took part"
    assert m.metrics.retries == 0 and m.metrics.tokens_wasted == 0
    assert not m.router.down
    samples = [s for groups, _ in batches for g in groups for s in g.samples]
    assert all(len(s.response_ids) == 24 for s in samples)
