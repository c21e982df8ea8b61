"""A CPU step cut in two: on a machine where a step runs on one thread, a large step runs as two
parts (decode rows and newcomers' prefills), one on a helper thread, each an ordinary single-threaded
pass that also samples its rows. On a CPU whose second core is shared with the HTTP thread and a rollout client,
the helper's part picks up whatever that core has free, with none of an OpenMP team's barrier
stalls when it has none. The step's uniforms are drawn once, in row order, so the tokens do not
depend on the cut; the cut follows the two parts' measured times.

When the other core is free, one step on a team of threads over every core is faster still (the
weights are read once, not once a part: SmolLM2-135M in fp32, 40-48 decode rows, 130 ms a step
against 155 split; 1-7 rows, 45 ms against 71 on one thread); when a neighbour (a trainer, a
rollout client) keeps that core busy, the team stalls at every barrier (84 ms against 23). So each
step size is run the way that measured faster there (`TwoWays`), and the other way is tried again
now and then, since neighbours come and go.
"""
from __future__ import annotations

import concurrent.futures
import statistics
import time

import torch

from inference_server.model_runner import DecoderRunner
from inference_server.sequence import Sequence

# Where a split step cuts its rows, in plan_chunks' units (key positions): a decode row's work
# beyond its key positions, and a prefill token's (rough CPU figures for a tiny decoder: a prefill
# token costs about as much as 200 key positions of decode attention). The learnt share corrects them.
ROW_WORK, PREFILL_WORK = 64, 200


class TwoWays:
    """Which of two ways to run a step ("team": one step on an OpenMP team over every core; "own":
    the engine thread alone, or two single-threaded parts), per step size (a power of two of its
    work). For each size, the way not taken is tried for a few steps of that size, after a few of
    that size taken the best way, and the median seconds per unit of work compared; the first step
    of a try pays for the change (a team's sleeping thread, a helper that finds the team's thread
    still spinning), so it is left out. Each size keeps its own recent steps and its own try: under
    HTTP traffic a newcomer joins nearly every other step, so step sizes interleave, and a try that
    needed consecutive steps of one size never came (a server's steps all ran split, 0 on the team).
    A try comes after `first_retry` steps of that size, then after twice as many each time the
    other way loses again (up to `max_retry`), back to `first_retry` when it wins: when the team
    stalls 3.6x behind a busy neighbour, its tries cost about 2% of the steps. A size starts on its
    own way (the split), which never stalls, so a crowded host (servers and a trainer sharing two
    cores) meets the team only in a try.

    A neighbour that comes while the team is best is seen at the first step it stalls: a team step
    `STALL` times its size's recent median (or a try's first step that far behind the way it tries
    to beat) sends every size back to its own way at once, and no size tries the team for `hold` steps
    (doubled at each stall up to `max_retry`, back to `first_retry` when the team wins a try: step
    sizes come and go, and each size trying on its own paid a stalled step each). Beside a trainer's step the team stalls
    at every barrier, ~40x: SmolLM2-135M's decode steps of ~20 rows took 1.3-2.0 s against 30-40 ms,
    and a size that learnt the team while the trainer waited for its batch kept it for the ~12
    steps until its next try (12-20 s of every ~25 s train step, the job's generation at a tenth
    of its rate)."""

    WAYS = ("own", "team")                              # the first is where a step size starts
    BASE, TRY = 3, 4                                    # steps compared before a try, steps a try takes
    STALL = 3.0                                         # a team step this many times the expected: a neighbour came

    def __init__(self, first_retry: int = 8, max_retry: int = 512):
        self.first_retry, self.max_retry = first_retry, max_retry
        self.best: dict[int, str] = {}
        self.since: dict[int, int] = {}                 # steps of that size since the last try
        self.retry: dict[int, int] = {}
        self.recent: dict[int, list[float]] = {}        # seconds a unit of the last steps of a size, the best way
        self.trying: dict[int, dict] = {}               # size -> steps left, base, units
        self.taken = {way: 0 for way in self.WAYS}
        self.stalls = 0                                 # times a neighbour was seen stalling the team
        self.hold, self.hold_next = 0, first_retry      # steps before any size may try the team again, and the next
                                                        # such hold (doubled at each stall, up to max_retry)

    def _other(self, size: int) -> str:
        return self.WAYS[1 - self.WAYS.index(self.best[size])]

    def pick(self, work: int) -> str:
        size = max(1, work).bit_length()
        best = self.best.setdefault(size, self.WAYS[0])
        self.hold = max(0, self.hold - 1)
        if size in self.trying:
            return self._other(size)
        base = self.recent.get(size, [])
        if best != "team" and self.hold:            # a neighbour stalled the team lately: no size tries it yet
            return best
        if len(base) == self.BASE and self.since.get(size, 0) >= self.retry.setdefault(size, self.BASE):
            self.trying[size] = {"left": self.TRY, "base": statistics.median(base), "units": []}
            return self._other(size)
        return best

    def record(self, work: int, way: str, seconds: float) -> None:
        size, unit = max(1, work).bit_length(), seconds / max(1, work)
        self.taken[way] += 1
        t = self.trying.get(size)
        if t is not None and way != self.best[size]:
            if way == "team" and unit > self.STALL * t["base"]:     # a stalled team loses its try at once
                t["left"], t["units"] = 0, [unit]
                self._stalled()
            else:
                t["left"] -= 1
                if t["left"] < self.TRY - 1:
                    t["units"].append(unit)
            if t["left"] == 0:
                self.trying.pop(size, None)
                self.recent[size], self.since[size] = [], 0
                if statistics.median(t["units"]) < t["base"]:
                    # the try's steps are the new way's recent ones: its first stall is seen at once
                    self.best[size], self.retry[size] = way, self.first_retry
                    self.recent[size] = t["units"][-self.BASE:]
                    if way == "team":
                        self.hold_next = self.first_retry
                else:
                    self.retry[size] = min(self.max_retry, max(self.first_retry, 2 * self.retry[size]))
            return
        recent = self.recent.get(size, [])
        if way == "team" and recent and unit > self.STALL * statistics.median(recent):
            self._stalled()
            return
        self.recent[size] = (recent + [unit])[-self.BASE:]
        self.since[size] = self.since.get(size, 0) + 1

    def _stalled(self) -> None:
        """A neighbour came: every size that runs on the team goes back to its own way, and none tries
        the team for `hold` steps (a stalled try's first step ends it)."""
        self.stalls += 1
        self.hold, self.hold_next = self.hold_next, min(self.max_retry, 2 * self.hold_next)
        for size, way in self.best.items():
            if way == "team":
                self.best[size], self.recent[size], self.since[size] = self.WAYS[0], [], 0
                self.retry[size] = self.first_retry
                self.trying.pop(size, None)


class SplitStepRunner:
    """A DecoderRunner whose big steps run as two parts: decode rows cut at one slot, and the
    newcomers' prefills dealt between the parts, so that a step heavy with prefill keeps both cores
    busy too (one thread taking every prefill left the other idle for most of such a step)."""

    def __init__(self, runner: DecoderRunner, threads: int = 1, min_rows: int = 16, min_work: int = 16 * 512,
                 team: int = 1):
        self.runner, self.min_rows, self.min_work = runner, min_rows, min_work
        self.threads, self.team = threads, team
        self.share = 0.5                        # of a split step's work that the helper takes
        self.ways = TwoWays()
        self.verify_ways = TwoWays()            # steps that verify drafts, apart: other shapes
        self._helper = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="riptide-step-half", initializer=torch.set_num_threads, initargs=(threads,))

    def step(self, decode: list[Sequence], prefill: list[Sequence], sampler) -> tuple[list[int], list[float]]:
        b = len(decode)
        pos = [s.num_tokens - 1 for s in decode]
        chunks = self.runner.plan(decode, pos) if b else []
        row_work = [w for start, end, longest in chunks for w in [longest + ROW_WORK] * (end - start)]
        groups: dict[tuple, list[int]] = {}     # newcomers with the same tokens stay together (computed once)
        for i, s in enumerate(prefill):
            groups.setdefault((s.cached, *s.all_ids), []).append(i)
        group_work = [(PREFILL_WORK * (prefill[idx[0]].num_tokens - prefill[idx[0]].cached), idx) for idx in groups.values()]
        total = sum(row_work) + sum(w for w, _ in group_work)
        way = self.ways.pick(total) if self.team > self.threads else "own"
        t = time.perf_counter()
        if way == "team":
            torch.set_num_threads(self.team)        # this thread's OpenMP team, and the C kernels' threads
            try:
                out = self.runner.step(decode, prefill, sampler)
            finally:
                torch.set_num_threads(self.threads)
        elif total < self.min_work or (b < self.min_rows and len(group_work) < 2):
            out = self.runner.step(decode, prefill, sampler)
        else:
            out = self._split(decode, prefill, sampler, pos, chunks, row_work, group_work, total)
        if self.team > self.threads:
            self.ways.record(total, way, time.perf_counter() - t)
        return out

    def verify_step(self, decode, verify, prefill, sampler) -> tuple[list[int], list[float]]:
        """A step with drafts to verify (speculative.py): one part, on the engine thread alone or on
        the team, whichever measured faster for steps of its size (few rows: the team, on a quiet host)."""
        if self.team <= self.threads:
            return self.runner.verify_step(decode, verify, prefill, sampler)
        total = sum(1 + len(d) for _, d in verify) + len(decode) + sum(s.num_tokens - s.cached for s in prefill)
        way, t = self.verify_ways.pick(total), time.perf_counter()
        if way == "team":
            torch.set_num_threads(self.team)
        try:
            return self.runner.verify_step(decode, verify, prefill, sampler)
        finally:
            if way == "team":
                torch.set_num_threads(self.threads)
            self.verify_ways.record(total, way, time.perf_counter() - t)

    def _split(self, decode, prefill, sampler, pos, chunks, row_work, group_work, total):
        b = len(decode)
        mid, mine = self._cut(row_work, group_work, total)
        theirs = sorted(i for _, idx in group_work for i in idx if i not in mine)
        mine = sorted(mine)

        def part(lo: int, hi: int) -> list[tuple[int, int, int]]:
            # a chunk that spans the cut becomes two, each padded only to its own longest row
            return [(max(a, lo), min(e, hi), max(pos[max(a, lo):min(e, hi)]) + 1)
                    for a, e, _ in chunks if a < hi and e > lo]
        u = sampler.draw(decode + prefill)      # in row order, so the tokens do not depend on the cut

        def uniforms(lo: int, hi: int, news: list[int]):
            return None if u is None else torch.cat([u[lo:hi], u[[b + i for i in news]]])
        u1, u2 = uniforms(0, mid, theirs), uniforms(mid, b, mine)      # both before the helper holds the GIL
        first = self._helper.submit(self._sampled_part, sampler, u1, decode[:mid], pos[:mid], 0,
                                    part(0, mid), [prefill[i] for i in theirs])
        (tokens, logprobs), t_own = self._sampled_part(sampler, u2, decode[mid:], pos[mid:], mid,
                                                       part(mid, b), [prefill[i] for i in mine])
        (tokens1, logprobs1), t_helper = first.result()
        # move the cut toward equal times: the thread that took longer gets less next step
        self.share = min(0.95, max(0.05, self.share + 0.02 * (t_own - t_helper) / (t_own + t_helper)))
        out_tokens = tokens1[:mid] + tokens[:b - mid] + [0] * len(prefill)
        out_logprobs = logprobs1[:mid] + logprobs[:b - mid] + [0.0] * len(prefill)
        for news, toks, lps, off in ((theirs, tokens1, logprobs1, mid), (mine, tokens, logprobs, b - mid)):
            for j, i in enumerate(news):
                out_tokens[b + i], out_logprobs[b + i] = toks[off + j], lps[off + j]
        return out_tokens, out_logprobs

    def _cut(self, row_work: list[int], group_work: list[tuple[int, list[int]]], total: int) -> tuple[int, set[int]]:
        """(mid, mine): the helper takes decode rows [0, mid) and the newcomers not in `mine`; the
        engine thread the rows from mid and the newcomers in `mine`, so that the helper's share of
        the work is about `share`. Newcomers are dealt biggest first to the part furthest below
        its target; the decode cut then fills the helper up to its target."""
        target = {True: (1 - self.share) * total, False: self.share * total}    # True: the engine thread
        load, mine = {True: 0, False: 0}, set()
        for w, idx in sorted(group_work, key=lambda g: -g[0]):
            own = (target[True] - load[True]) >= (target[False] - load[False])
            load[own] += w
            if own:
                mine.update(idx)
        acc, mid, room = 0, 0, target[False] - load[False]
        for w in row_work:
            if acc + w / 2 > room:
                break
            acc += w
            mid += 1
        return mid, mine

    def _sampled_part(self, sampler, u, decode, pos, slot0, chunks, prefill) -> tuple[tuple[list, list], float]:
        if not decode and not prefill:
            return ([], []), 0.0
        t = time.perf_counter()
        with torch.inference_mode():
            out = sampler.sample(self.runner.part(decode, pos, slot0, chunks, prefill), decode + prefill, u)
        return out, time.perf_counter() - t

    # ---- the rest is the wrapped runner's ----------------------------------------------------------
    def forward(self, decode: list[Sequence], prefill: list[Sequence]) -> torch.Tensor:
        return self.runner.forward(decode, prefill)

    def move(self, src: int, dst: int, length: int) -> None:
        self.runner.move(src, dst, length)

    def release(self, seq: Sequence) -> None:
        self.runner.release(seq)

    def better_order(self, lengths: list[int]) -> list[int] | None:
        return self.runner.better_order(lengths)

    def reorder(self, order: list[int], lengths: list[int]) -> None:
        self.runner.reorder(order, lengths)
