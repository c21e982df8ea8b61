"""Speculative decoding of the tail (inference_server/speculative.py): drafts from a request's siblings
and its prompt's history, verified by the policy, change nothing of what is sampled: the distribution
of sampled continuations (chi-square over 20,000 samples each way, at temperature 1 and with top-p
0.9), greedy tokens, per-token logprobs against transformers' recompute, and the weight version each
token carries, across a push in the middle of a request too."""
from __future__ import annotations

import collections
import random

import pytest
import torch
import torch.nn.functional as F

from inference_server.engine import Engine, EngineArgs
from inference_server.sequence import SamplingParams, Sequence
from inference_server.speculative import DraftIndex, SpecPolicy


@pytest.fixture(scope="module")
def peaked_model(tmp_path_factory):
    """A tiny Llama over a 60-character vocabulary whose head is scaled so that its next-token
    distributions are peaked (a random model's are nearly uniform, and nothing would be accepted):
    the shape of a trained model's, with a vocabulary small enough to count."""
    from transformers import AutoModelForCausalLM
    from inference_server.tiny_model import build_tiny_model
    path = build_tiny_model(tmp_path_factory.mktemp("peaked"), hidden=64, layers=2, heads=4, kv_heads=2,
                            max_positions=512, seed=3, arch="llama", tokenizer="chars")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)
    model.save_pretrained(path)
    return str(path)


def engine(model: str, speculative: str, **kw) -> Engine:
    return Engine(EngineArgs(model, context_length=512, cpu_split=False, kv_layout="paged", kv_block_size=16,
                             speculative=speculative, **kw))


def generate(e: Engine, seqs: list[Sequence], actions: dict | None = None) -> list[Sequence]:
    """Step `e` on this thread until `seqs` finish; actions[k](e) runs before step k."""
    e.add(seqs)
    actions = dict(actions or {})
    with torch.inference_mode():
        for step in range(100_000):
            if step in actions:
                actions.pop(step)(e)
            e._run_commands()
            if not e.scheduler.has_work and not actions:
                return seqs
            if e.scheduler.has_work:
                e.step()
    raise AssertionError("the engine did not finish")


def first_tokens(model: str, speculative: str, params: SamplingParams, n: int, prompt: list[int], seed: int):
    e = engine(model, speculative, seed=seed)
    seqs = [Sequence(f"s{i}", list(prompt), params) for i in range(n)]
    generate(e, seqs)
    return collections.Counter(tuple(s.output_ids[:3]) for s in seqs), e.stats


def chi_square_p(a: collections.Counter, b: collections.Counter) -> float:
    """Two-sample chi-square test of homogeneity; cells with an expected count under 5 pooled.
    Returns (p-value, cells): the chi-square survival function is the upper regularized gamma."""
    na, nb = sum(a.values()), sum(b.values())
    cells, rest = [], [0, 0]
    for key in set(a) | set(b):
        row = (a.get(key, 0), b.get(key, 0))
        if min(sum(row) * na, sum(row) * nb) / (na + nb) < 5:
            rest[0] += row[0]
            rest[1] += row[1]
        else:
            cells.append(row)
    if sum(rest):
        cells.append(tuple(rest))
    stat = 0.0
    for x, y in cells:
        total = x + y
        for obs, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (obs - expected) ** 2 / expected
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64))), len(cells)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_drafts_leave_the_distribution_of_sampled_continuations_unchanged(peaked_model, top_p):
    prompt = [random.Random(5).randrange(6, 60) for _ in range(12)]
    params = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=top_p, ignore_eos=True)
    off, _ = first_tokens(peaked_model, "off", params, 20_000, prompt, seed=1)
    on, stats = first_tokens(peaked_model, "on", params, 20_000, prompt, seed=2)
    # the drafts were there and the policy took many of them: the test would pass trivially otherwise
    assert stats.spec_drafted > 10_000 and stats.spec_accepted > 0.2 * stats.spec_drafted, stats
    assert stats.generation_tokens == 4 * 20_000 and stats.row_forwards < stats.generation_tokens
    p, cells = chi_square_p(off, on)
    assert cells > 20, cells                 # the continuations are spread over many outcomes
    assert p > 0.01, (p, cells, off.most_common(5), on.most_common(5))


def test_greedy_tokens_are_the_same_token_for_token(peaked_model, tiny_model):
    for model in (peaked_model, tiny_model):
        rng = random.Random(7)
        vocab = 60 if model == peaked_model else 1900
        prompts = [[rng.randrange(6, vocab) for _ in range(rng.randint(3, 40))] for _ in range(6)]
        outs = {}
        for mode in ("off", "on"):
            e = engine(model, mode)
            seqs = [Sequence(f"g{i}-{j}", list(p), SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True))
                    for i, p in enumerate(prompts) for j in range(3)]
            outs[mode] = [s.output_ids for s in generate(e, seqs)]
            if mode == "on":
                assert e.stats.spec_accepted > 0, e.stats
        assert outs["on"] == outs["off"]


def recompute(models: list, ids: list[int], cuts: list[int]) -> torch.Tensor:
    """Next-token log-softmax at every position of `ids`, positions [cuts[i], cuts[i+1]) computed by
    models[i] over the keys and values the earlier ones left (as a server whose weights changed
    between two steps holds them)."""
    from transformers import DynamicCache
    cache, rows = DynamicCache(), []
    bounds = cuts + [len(ids)]
    with torch.no_grad():
        for m, lo, hi in zip(models, bounds, bounds[1:]):
            if hi > lo:
                out = m(torch.tensor([ids[lo:hi]]), past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                rows.append(out.logits[0].float())
    return F.log_softmax(torch.cat(rows), dim=-1)


def test_logprobs_and_versions_are_the_verifying_forwards_also_across_a_push(peaked_model, tmp_path):
    from transformers import AutoModelForCausalLM
    from inference_server import weights
    v0 = AutoModelForCausalLM.from_pretrained(peaked_model, dtype=torch.float32).eval()
    v1 = AutoModelForCausalLM.from_pretrained(peaked_model, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in v1.parameters():
            p.add_(0.02 * torch.randn_like(p))
    new = {n: p.detach().clone() for n, p in weights.parameters(v1).items()}

    e = engine(peaked_model, "on", seed=4)
    prompt = [random.Random(9).randrange(6, 60) for _ in range(20)]
    seqs = [Sequence(f"s{i}", list(prompt), SamplingParams(max_new_tokens=40, temperature=1.0, ignore_eos=True))
            for i in range(8)]
    generate(e, seqs, {6: lambda e: e.swap_weights(new, 1)})
    assert e.stats.spec_accepted > 0, e.stats
    moved = 0
    for s in seqs:
        versions = s.output_versions
        assert versions == sorted(versions) and set(versions) <= {0, 1}
        first_new = versions.index(1) if 1 in versions else len(versions)
        moved += 0 < first_new < len(versions)
        ids = s.prompt_ids + s.output_ids
        # the first token of version 1 came from a forward of version 1 at its previous position,
        # whose keys and values (and everything after) version 1 computed
        cut = len(s.prompt_ids) + first_new - 1
        lp = recompute([v0, v1], ids, [0, cut])
        want = torch.tensor([lp[len(s.prompt_ids) + j - 1, t] for j, t in enumerate(s.output_ids)])
        got = torch.tensor(s.output_logprobs)
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert moved > 0                          # the push landed in the middle of requests


def test_the_draft_index_follows_siblings_and_forgets_old_versions():
    index = DraftIndex(max_ngram=3, keep_versions=1, min_score=0.0)
    a = Sequence("a", [1, 2, 3], SamplingParams())
    a.output_ids = [7, 8, 9, 10]
    index.update(a, version=0)
    b = Sequence("b", [1, 2, 3], SamplingParams())
    b.output_ids = [7, 8]
    assert index.propose(b, 3) == [9, 10]               # its sibling went 7 8 -> 9 10
    other = Sequence("c", [4, 5], SamplingParams())
    other.output_ids = [7, 8]
    assert index.propose(other, 3) == []                # another prompt: nothing of a's
    index.update(b, version=3)                          # version 0 is past keep_versions now
    b.output_ids = [7, 8, 11]
    assert index.propose(b, 3) == []


def test_auto_drafts_where_the_measured_cost_pays_and_not_at_a_full_batch():
    policy = SpecPolicy(k=4, explore_every=1_000)
    policy.acceptance, policy.drafts_per_row = 0.6, 4.0
    # a step reads every weight once: 40 ms, plus 2 ms a row (a CPU's shape at 64 rows is arithmetic)
    for rows in (1, 2, 5, 8, 16, 40, 64, 100, 200, 320):
        for _ in range(3):
            policy.record(rows, 0.040 + 0.002 * rows)
    assert policy.should_draft(1) and policy.should_draft(4)
    assert not policy.should_draft(64)


def test_a_server_reports_drafts_per_request_and_in_its_metrics(tiny_model, tmp_path_factory):
    import requests
    from conftest import start_server
    srv = start_server(tiny_model, tmp_path_factory, "--speculative", "on", "--speculative-tokens", "4")
    try:
        out = requests.post(f"{srv.url}/generate", json={
            "input_ids": [11, 12, 13, 14, 15], "return_logprob": True,
            "sampling_params": {"n": 8, "max_new_tokens": 48, "temperature": 0.0, "ignore_eos": True}},
            timeout=120).json()
        metas = [o["meta_info"] for o in out]
        assert all(m["completion_tokens"] == 48 for m in metas)
        assert sum(m["spec_accepted_tokens"] for m in metas) > 0
        assert all(m["spec_verify_ct"] + m["spec_accepted_tokens"] == 48 for m in metas)
        text = requests.get(f"{srv.url}/metrics", timeout=30).text
        drafted = [float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("riptide_spec_draft_tokens_total")]
        assert drafted and drafted[0] >= sum(m["spec_draft_tokens"] for m in metas) > 0
    finally:
        srv.stop()


def test_speculative_on_where_it_cannot_run_is_refused_by_name(tmp_path):
    from inference_server.tiny_model import build_tiny_model
    path = str(build_tiny_model(tmp_path / "m", hidden=64, layers=1, heads=2, kv_heads=1, vocab=300))
    with pytest.raises(ValueError, match="speculative=on needs the paged KV cache"):
        engine_args = EngineArgs(path, context_length=128, kv_layout="contiguous", speculative="on")
        Engine(engine_args)
    with pytest.raises(ValueError, match="speculative='fast'"):
        Engine(EngineArgs(path, context_length=128, speculative="fast"))
