"""A CPU step cut in two: on a machine where a step runs on one thread, a large step runs as two
parts of the decode rows, one on a helper thread, each an ordinary single-threaded pass that also
samples its rows. On a CPU whose second core is shared with the HTTP thread and a rollout client,
the helper's part picks up whatever that core has free, with none of an OpenMP team's barrier
stalls when it has none. The step's uniforms are drawn once, in row order, so the tokens do not
depend on the cut; the cut follows the two parts' measured times.
"""
from __future__ import annotations

import concurrent.futures
import time

import torch

from inference_server.model_runner import DecoderRunner
from inference_server.sequence import Sequence

# Where a split step cuts its rows, in plan_chunks' units (key positions): a decode row's work
# beyond its key positions, and a prefill token's (rough CPU figures for a tiny decoder: a prefill
# token costs about as much as 200 key positions of decode attention). The learnt share corrects them.
ROW_WORK, PREFILL_WORK = 64, 200


class SplitStepRunner:
    """A DecoderRunner whose steps of at least `min_rows` decode rows run as two parts."""

    def __init__(self, runner: DecoderRunner, threads: int = 1, min_rows: int = 16):
        self.runner, self.min_rows = runner, min_rows
        self.share = 0.5                        # of a split step's work that the helper takes
        self._helper = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="riptide-step-half", initializer=torch.set_num_threads, initargs=(threads,))

    def step(self, decode: list[Sequence], prefill: list[Sequence], sampler) -> tuple[list[int], list[float]]:
        b = len(decode)
        if b < self.min_rows:
            return self.runner.step(decode, prefill, sampler)
        pos = [s.num_tokens - 1 for s in decode]
        chunks = self.runner.plan(decode, pos)
        mid = self._cut(chunks, prefill)

        def part(lo: int, hi: int) -> list[tuple[int, int, int]]:
            # a chunk that spans the cut becomes two, each padded only to its own longest row
            return [(max(a, lo), min(e, hi), max(pos[max(a, lo):min(e, hi)]) + 1)
                    for a, e, _ in chunks if a < hi and e > lo]
        u = sampler.draw(decode + prefill)
        u1, u2 = (None, None) if u is None else (u[:mid], u[mid:])
        first = self._helper.submit(self._sampled_part, sampler, u1, decode[:mid], pos[:mid], 0, part(0, mid), [])
        (tokens, logprobs), t_own = self._sampled_part(sampler, u2, decode[mid:], pos[mid:], mid, part(mid, b),
                                                       prefill)
        (tokens1, logprobs1), t_helper = first.result()
        # move the cut toward equal times: the thread that took longer gets less next step
        self.share = min(0.95, max(0.05, self.share + 0.02 * (t_own - t_helper) / (t_own + t_helper)))
        return tokens1 + tokens, logprobs1 + logprobs

    def _cut(self, chunks, prefill: list[Sequence]) -> int:
        """The first row of the engine thread's part: where the work (padded key positions and a
        per-row share) splits as `share` says; the engine thread's side also takes the prefill."""
        work = []
        for start, end, longest in chunks:
            work += [longest + ROW_WORK] * (end - start)
        target = self.share * (sum(work) + PREFILL_WORK * sum(s.num_tokens for s in prefill))
        acc, mid = 0, 0
        for w in work[:-1] if not prefill else work:
            if acc + w / 2 > target:
                break
            acc += w
            mid += 1
        return max(mid, 1)

    def _sampled_part(self, sampler, u, decode, pos, slot0, chunks, prefill) -> tuple[tuple[list, list], float]:
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
