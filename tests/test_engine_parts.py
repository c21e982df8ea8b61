"""Scheduler (no torch), decode-attention planning, KV slot permutation and sampler on their own."""
import pytest
import torch

from inference_server.kv_cache import SlotKVCache
from inference_server.model_runner import CALL_COST, chunk_cost, plan_chunks
from inference_server.sampler import Sampler
from inference_server.scheduler import Scheduler
from inference_server.sequence import SamplingParams, Sequence, SeqStatus


def seq(rid, n=3, **kw):
    return Sequence(rid, list(range(n)), SamplingParams(**kw))


def test_scheduler_keeps_slots_dense():
    s = Scheduler(max_running=3, max_prefill_tokens=100, context_length=64)
    a, b, c, d = seq("a"), seq("b"), seq("c"), seq("d")
    for x in (a, b, c, d):
        s.add(x)
    assert s.schedule() == ([], [a, b, c]) and [x.slot for x in (a, b, c)] == [0, 1, 2]
    assert s.schedule() == ([a, b, c], [])              # d waits for a slot
    assert s.remove(a) == (2, 0)                       # c moves into a's hole
    assert (c.slot, s.running) == (0, [c, b])
    assert s.schedule() == ([c, b], [d]) and d.slot == 2   # d joins while c and b decode
    assert s.remove(d) is None                         # the last slot leaves no hole


def test_scheduler_prefill_budget_and_retract():
    s = Scheduler(max_running=8, max_prefill_tokens=10, context_length=64)
    a, b = seq("a", 6), seq("b", 6)
    s.add(a), s.add(b)
    assert s.schedule() == ([], [a])                   # b does not fit the token budget
    assert s.schedule() == ([a], [b])
    s.retract_all()
    assert list(s.waiting) == [a, b] and not s.running
    assert a.status is SeqStatus.WAITING and a.slot is None and a.num_retractions == 1
    s.paused = True
    assert s.schedule() == ([], []) and not s.has_work


def test_attention_chunks_follow_lengths():
    # equal rows share one call; a long row among short ones gets its own instead of padding all
    assert plan_chunks([50] * 8) == [(0, 8, 50)]
    assert plan_chunks([900, 40, 40, 40]) == [(0, 1, 900), (1, 4, 40)]
    ragged = [17, 900, 33, 410, 64, 12, 700, 150]
    ordered = sorted(ragged, reverse=True)
    chunks = plan_chunks(ordered)
    assert chunks[0][0] == 0 and chunks[-1][1] == len(ordered) and 1 < len(chunks) < len(ordered)
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))          # contiguous, covering all rows
    assert all(c[2] == max(ordered[c[0]:c[1]]) for c in chunks)
    # sorted slots cost less than the same rows in arrival order, and less than one padded call
    assert chunk_cost(ordered) < chunk_cost(ragged) and chunk_cost(ordered) < 8 * 900 + CALL_COST


def test_kv_permute_moves_each_slot_with_its_length():
    kv = SlotKVCache(num_layers=2, num_slots=5, num_kv_heads=1, context_length=8, head_dim=2,
                     dtype=torch.float32, device=torch.device("cpu"))
    lengths = [3, 8, 1, 5, 2]
    for slot, n in enumerate(lengths):
        kv.k[:, slot, :, :n] = slot + 1
        kv.v[:, slot, :, :n] = -(slot + 1)
    order = [1, 3, 0, 4, 2]            # new slot i <- old slot order[i]: the cycle 0<-1<-3<-4<-2<-0
    kv.permute(order, lengths)
    for new, old in enumerate(order):
        n = lengths[old]
        assert torch.all(kv.k[:, new, :, :n] == old + 1) and torch.all(kv.v[:, new, :, :n] == -(old + 1))


def test_scheduler_reorder_renumbers_slots():
    s = Scheduler(max_running=4, max_prefill_tokens=100, context_length=64)
    a, b, c = seq("a"), seq("b"), seq("c")
    for x in (a, b, c):
        s.add(x)
    s.schedule()
    s.reorder([2, 0, 1])
    assert s.running == [c, a, b] and [x.slot for x in (c, a, b)] == [0, 1, 2]


def test_sampler_truncation_and_seed():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    greedy = logits.argmax(-1).tolist()
    seqs = [seq("k", top_k=1), seq("p", top_p=1e-6), seq("m", min_p=1.0), seq("g", temperature=0.0)]
    tokens, logprobs = sampler(logits, seqs)
    assert tokens == greedy
    assert torch.allclose(torch.tensor(logprobs), torch.log_softmax(logits, -1).gather(1, torch.tensor(greedy)[:, None])[:, 0])
    seeded = [seq(str(i), seed=123) for i in range(4)]
    for s in seeded:
        s.generator = torch.Generator().manual_seed(123)
    first, _ = sampler(logits, seeded)
    for s in seeded:
        s.generator = torch.Generator().manual_seed(123)
    again, _ = sampler(logits, seeded)
    assert first == again


def test_sampler_samples_the_distribution():
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]])).repeat(4000, 1)
    tokens, _ = Sampler(seed=1, device=torch.device("cpu"))(logits, [seq(str(i)) for i in range(4000)])
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.1, 0.6, 0.3]), atol=0.03)


def test_a_split_step_samples_what_one_pass_does(tiny_model):
    """A step cut between two threads (CPU, >= 16 rows) gives each row the token and logprob that
    one pass over all rows gives: same uniforms, whatever the cut (with newcomers' prefills dealt
    between the parts, two of them with one prompt)."""
    from transformers import AutoModelForCausalLM

    from inference_server.cpu_split import SplitStepRunner
    from inference_server.model_runner import DecoderRunner
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    lengths = sorted(torch.randint(4, 200, (24,), generator=g).tolist(), reverse=True)
    ids = [torch.randint(0, 2000, (n,), generator=g).tolist() for n in lengths + [37, 90, 12]]
    ids.append(ids[-2])                               # a newcomer with another's prompt (a GRPO group)

    def run(split: bool, share: float = 0.5, way: str = "own"):
        runner = DecoderRunner(model, num_slots=32, context_length=256)
        if split:
            runner = SplitStepRunner(runner, threads=1, team=2)
            runner.share = share
            runner.ways.pick = lambda work: way
        seqs = []
        for slot, x in enumerate(ids):
            s = Sequence(str(slot), x, SamplingParams(temperature=0.8 if slot % 3 else 0.0))
            s.slot = slot
            seqs.append(s)
        decode, newcomer = seqs[:-4], seqs[-4:]
        with torch.inference_mode():
            for s in decode:                          # each row's prompt minus its last token
                s.prompt_ids, last = s.prompt_ids[:-1], s.prompt_ids[-1]
                runner.forward([], [s])
                s.prompt_ids = s.prompt_ids + [last]
            return runner.step(decode, newcomer, Sampler(seed=7, device=torch.device("cpu")))
    whole = run(split=False)
    for share, way in ((0.2, "own"), (0.5, "own"), (0.9, "own"), (0.5, "team")):
        tokens, logprobs = run(split=True, share=share, way=way)
        assert tokens == whole[0]
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(whole[1]), atol=1e-4)


def test_a_cpu_step_goes_the_way_that_measured_faster_and_tries_the_other_again():
    """TwoWays (cpu_split): a step size runs the way whose last steps took less time a unit of
    work; the other way is tried after a few steps, less often while it keeps losing, and taken
    over when it wins (a neighbour came or went)."""
    from inference_server.cpu_split import TwoWays
    ways, cost = TwoWays(first_retry=4, max_retry=64), {"team": 1.0, "own": 2.0}

    def run(steps: int) -> list[str]:
        taken = []
        for _ in range(steps):
            way = ways.pick(1000)
            ways.record(1000, way, cost[way])
            taken.append(way)
        return taken
    first = run(200)
    assert first[:3] == ["own"] * 3 and first[3:7] == ["team"] * 4       # starts on its own, tries the team
    assert first[-100:].count("team") > 90                                # which won
    cost.update(team=3.0)                                                 # a busy neighbour: the team stalls
    later = run(400)
    assert later[-100:].count("own") > 90                                 # taken over at the next try
    assert later[-100:].count("team") <= 2 * TwoWays.TRY                  # the loser is tried less and less

    # sizes that interleave (a newcomer every other step, as under HTTP traffic) are each tried
    mixed, cost = TwoWays(first_retry=4, max_retry=64), {"team": 1.0, "own": 2.0}
    taken = {1000: [], 100000: []}
    for i in range(200):
        work = (1000, 100000)[i % 2]
        way = mixed.pick(work)
        mixed.record(work, way, cost[way] * work / 1000)
        taken[work].append(way)
    assert all(t[-50:].count("team") > 45 for t in taken.values())


def test_a_team_that_stalls_behind_a_new_neighbour_is_left_at_its_first_slow_step():
    """A trainer's step beside the server stalls the team at every barrier (~40x a step): the first
    such step sends every step size back to its own way, and a later try of the team that stalls
    ends at its first step; once the neighbour is gone, the team wins its try again."""
    from inference_server.cpu_split import TwoWays
    ways, cost = TwoWays(first_retry=4, max_retry=64), {"team": 1.0, "own": 2.0}

    def run(steps: int, sizes=(1000, 100000)) -> dict[int, list[str]]:
        taken = {w: [] for w in sizes}
        for i in range(steps):
            work = sizes[i % len(sizes)]
            way = ways.pick(work)
            ways.record(work, way, cost[way] * work / 1000)
            taken[work].append(way)
        return taken
    quiet = run(200)
    assert all(t[-50:].count("team") >= 45 for t in quiet.values())      # both sizes learnt the team
    cost.update(team=40.0)                                                # a trainer's step begins
    busy = run(400)
    stalled = sum(t.count("team") for t in busy.values())
    assert busy[1000][0] == "team" and busy[100000][0] == "own"           # one stalled step, and every size left it
    # each later try of the team stalls once and ends there; tries come less and less often
    assert stalled <= 1 + 2 * 7, stalled
    assert all(t[-100:].count("own") >= 98 for t in busy.values())
    assert ways.stalls >= 1
    cost.update(team=1.0)                                                 # the trainer waits for its batch
    after = run(400)
    assert all(t[-50:].count("team") >= 45 for t in after.values())


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "llama3_rope", "llama_head_dim_64"])
def test_fast_path_matches_transformers_for_each_family(family, tmp_path):
    """The fast path runs each family's own modules (its rotary_emb with llama3 scaling, Qwen3's q/k
    norms) around its own attention and KV cache: prefill and decode logits equal the model's forward."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen3Config

    from inference_server.model_runner import DecoderRunner
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg = {"llama": lambda: LlamaConfig(**common),
           "qwen3": lambda: Qwen3Config(**common, head_dim=16),
           "mistral": lambda: MistralConfig(**common, sliding_window=None),
           "llama3_rope": lambda: LlamaConfig(**common, rope_scaling={
               "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}),
           # head_dim 64, 2 query heads a KV head: the sizes prefill_attention.c is built for
           "llama_head_dim_64": lambda: LlamaConfig(**(common | dict(hidden_size=256, intermediate_size=256)))}[family]()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    runner = DecoderRunner(model, num_slots=2, context_length=256)
    ids = torch.randint(0, 300, (40,)).tolist()
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0]
        s = Sequence("a", ids[:30], SamplingParams())
        s.slot = 0
        got = [runner.forward([], [s])[0]]
        for t in ids[30:-1]:
            s.output_ids.append(t)
            got.append(runner.forward([s], [])[0])
    assert torch.allclose(torch.stack(got), want[29:39], atol=1e-5)


def test_a_groups_samples_share_the_prompts_prefill_and_sample_the_same(tiny_model):
    """GRPO sends a prompt n times. With prefix sharing the engine computes that prompt once per
    step it arrives in, and copies its KV cache to later arrivals while the first runs: prefill
    tokens per group fall from n x prompt to about one prompt, and every sample's tokens and
    logprobs are the ones a separate prefill gives (seeded sampling)."""
    import threading

    from inference_server.engine import Engine, EngineArgs
    from inference_server.sequence import SamplingParams, Sequence

    prompt = list(range(20, 60))                      # 40 tokens

    def group(share: bool) -> tuple[list, int, int]:
        engine = Engine(EngineArgs(tiny_model, context_length=256, prefix_share=share, cpu_split=False))
        engine.start()
        try:
            seqs, done = [], threading.Semaphore(0)
            for wave in ([0, 1, 2], [3], [4, 5, 6, 7]):   # arrivals spread over steps, as HTTP requests come
                batch = [Sequence(f"s{i}", list(prompt), SamplingParams(max_new_tokens=24, seed=i, ignore_eos=True),
                                  on_update=lambda s: s.finished and done.release()) for i in wave]
                seqs += batch
                engine.add(batch)
                if wave[0] == 0:
                    while engine.stats.steps < 2:          # the first wave is decoding when the rest arrive
                        threading.Event().wait(0.005)
            for _ in seqs:
                assert done.acquire(timeout=60)
            return [(s.output_ids, s.output_logprobs) for s in seqs], engine.stats.prompt_tokens, \
                engine.stats.shared_prompt_tokens
        finally:
            engine.shutdown()

    shared, computed, copied = group(True)
    alone, computed_alone, copied_alone = group(False)
    assert computed_alone == 8 * len(prompt) and copied_alone == 0
    assert computed < 2 * len(prompt) + 8 and computed + copied == 8 * len(prompt)
    for (ids, lps), (ids0, lps0) in zip(shared, alone):
        assert ids == ids0
        assert max(abs(a - b) for a, b in zip(lps, lps0)) < 1e-3


def test_a_command_its_caller_gave_up_on_does_not_stop_the_engine(tiny_model):
    """An HTTP handler awaiting an engine command through asyncio (wrap_future) cancels the
    command's future when its client goes away. Setting a cancelled future's result raises: the
    engine thread once died of it and the server never stepped again (a job hung on /commit).
    The command still runs; the engine goes on serving."""
    import threading

    from inference_server.engine import Engine, EngineArgs
    from inference_server.sequence import SamplingParams, Sequence

    engine = Engine(EngineArgs(tiny_model, context_length=256, cpu_split=False))
    engine.start()
    try:
        ran, release, finished, queued = threading.Event(), threading.Event(), threading.Event(), threading.Event()

        def slow():
            ran.set()
            release.wait(10)
            finished.set()

        running = engine.submit(slow)            # the engine thread is inside this command
        assert ran.wait(10)
        waiting = engine.submit(queued.set)
        failing = engine.submit(lambda: 1 / 0)
        assert running.cancel() and waiting.cancel() and failing.cancel()    # their callers gave up
        release.set()
        assert finished.wait(10) and queued.wait(10)                         # the commands ran all the same
        done = threading.Event()
        seq = Sequence("after", list(range(20, 30)), SamplingParams(max_new_tokens=4, ignore_eos=True),
                       on_update=lambda s: s.finished and done.set())
        engine.add([seq])
        assert done.wait(30) and len(seq.output_ids) == 4
        assert engine.running
    finally:
        engine.shutdown()


@pytest.mark.parametrize("threads", [1, 2])
def test_fp32_projections_on_the_cpu_kernel_equal_a_float64_matmul_as_closely_as_onednn(threads):
    """gemm.c serves the fused path's fp32 projections whose outputs are a multiple of 64 (every row
    count a decode step or a prefill has, biases as Qwen2's, rows of a wider tensor); its rounding is
    no worse than oneDNN's fp32 matmul (F.linear), and other shapes take F.linear."""
    import torch.nn.functional as F

    from inference_server.model_runner import _Linear
    from inference_server.paged_kernel import cpu_gemm
    if cpu_gemm() is None:
        pytest.skip("gemm.c not built here (no compiler, no AVX-512, or no OpenMP build): oneDNN serves")
    torch.manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for out, k, bias in [(192, 64, True), (128, 320, False), (640, 96, False)]:
            linears = [torch.nn.Linear(k, out // 2, bias=bias), torch.nn.Linear(k, out // 2, bias=bias)]   # stacked
            lin = _Linear(linears, pack=True)
            assert lin.panels is not None
            w = torch.cat([m.weight for m in linears]).double()
            b = torch.cat([m.bias for m in linears]).double() if bias else None
            for rows in (1, 5, 6, 7, 12, 13, 64, 257, 600):
                x = torch.randn(rows, 2 * k)[:, ::2]                  # a strided view: rows of a wider tensor
                with torch.inference_mode():
                    got, onednn = lin(x), F.linear(x, w.float(), None if b is None else b.float())
                want = F.linear(x.double(), w, b)
                assert got.shape == (rows, out) and got.dtype == torch.float32
                scale = want.abs().max()
                assert (got.double() - want).abs().max() / scale <= max(2 * (onednn.double() - want).abs().max() / scale, 1e-6)
        assert _Linear([torch.nn.Linear(64, 100)], pack=True).panels is None      # 100 outputs: oneDNN's
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("group", [1, 2, 3, 4])
def test_the_prefill_attention_kernel_equals_causal_attention_in_float64(group):
    """prefill_attention.c (fp32 prefills, head_dim 64): each position attends over itself and the
    positions before it, for 1-4 query heads a KV head and lengths around its tiles (4) and key blocks
    (16), q, k and v as views of one stacked projection; sizes it was not built for are refused."""
    import torch.nn.functional as F

    from inference_server.paged_kernel import prefill_attention, prefill_kernel
    fn = prefill_kernel(torch.float32)
    if fn is None:
        pytest.skip("the kernels were not built here (no compiler)")
    torch.manual_seed(group)
    kvh, d = 2, 64
    heads = kvh * group
    for n in (1, 3, 4, 5, 15, 16, 17, 33, 130):
        qkv = torch.randn(n, (heads + 2 * kvh) * d) * 2
        q = qkv[:, :heads * d].view(n, heads, d)
        k = qkv[:, heads * d:(heads + kvh) * d].view(n, kvh, d)
        v = qkv[:, (heads + kvh) * d:].view(n, kvh, d)
        out = torch.empty(n, heads, d)
        if not prefill_attention(fn, q, k, v, out, 0.125):
            pytest.skip("prefill_attention.c not built for this CPU (no AVX-512): SDPA serves")
        want = F.scaled_dot_product_attention(*(t.double().transpose(0, 1)[None] for t in (q, k, v)), is_causal=True,
                                              scale=0.125, enable_gqa=True)[0].transpose(0, 1)
        assert (out.double() - want).abs().max() < 5e-5, n
    big = torch.randn(8, 2, 128)
    assert not prefill_attention(fn, big, big[:, :1], big[:, :1], torch.empty(8, 2, 128), 0.1)   # head_dim 128
