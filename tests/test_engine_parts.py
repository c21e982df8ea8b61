"""Scheduler (no torch) and sampler on their own."""
import torch

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
