"""Turns logits into tokens and the logprobs a trainer will recompute.

The logprob is log_softmax(logits / temperature) at the sampled token, taken before top-k, top-p or
min-p truncation (at temperature 0: of the raw logits). Sampling is inverse-CDF (cumsum +
searchsorted), not torch.multinomial: on CPU it is ~20x cheaper at batch 64. On a CPU the common case
(no truncation) runs in C, a row at a time (paged_kernel.FusedSampler), by the same rule.
"""
from __future__ import annotations

import torch

from inference_server.paged_kernel import fused_sampler
from inference_server.sequence import Sequence


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.device = device
        self.fused = fused_sampler(device)          # CPU: one C pass a row instead of the vocab-wide ops

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
        # logits: [batch, vocab] float32
        return self.sample(logits, seqs, self.draw(seqs))

    def draw(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """The step's uniforms, one per row in `seqs` order (None when every row is greedy). Drawn
        apart from `sample`, so that rows sampled in several parts get what one call would give."""
        if all(s.params.greedy for s in seqs):
            return None
        return self._uniforms(seqs)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence],
               u: torch.Tensor | None) -> tuple[list[int], list[float]]:
        """Tokens and logprobs for `seqs` (rows of `logits`), with their uniforms `u` from `draw`."""
        params = [s.params for s in seqs]
        temps = [p.temperature for p in params]
        if self.fused is not None and logits.dtype == torch.float32 and not any(p.truncates for p in params):
            return self._sample_fused(logits, seqs, temps, u)
        if all(t in (0.0, 1.0) for t in temps):      # the common case: no division
            scaled = logits
        else:
            scaled = logits / torch.tensor([t if t > 0 else 1.0 for t in temps], device=logits.device)[:, None]
        # log_softmax by hand: the shifted logits and their exp serve the logprob and the draw both
        z = scaled - scaled.amax(dim=-1, keepdim=True)
        e = z.exp()
        log_total = e.sum(dim=-1).log()
        greedy = [t == 0.0 for t in temps]
        if u is None:
            tokens = logits.argmax(dim=-1)
        else:
            if any(p.truncates for p in params):
                e = self._truncate(e, params)
            cdf = e.cumsum(dim=-1)
            u = u.to(logits.device)
            tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
            tokens = tokens.clamp_(max=logits.shape[-1] - 1)
            if any(greedy):
                tokens = torch.where(torch.tensor(greedy, device=logits.device), logits.argmax(dim=-1), tokens)
        chosen = z.gather(1, tokens[:, None])[:, 0] - log_total
        self._top_logprobs(seqs, lambda want: z[want], log_total)
        return tokens.tolist(), chosen.tolist()

    @staticmethod
    def _top_logprobs(seqs: list[Sequence], shifted, log_total: torch.Tensor) -> None:
        """OpenAI's top_logprobs: the most likely tokens of the same distribution, for the rows that ask
        (`seq.next_top`); shifted(rows): those rows' scaled logits less their max."""
        want = [i for i, s in enumerate(seqs) if s.params.top_logprobs > 0]
        if not want:
            return
        z = shifted(want)
        values, ids = z.topk(min(max(seqs[i].params.top_logprobs for i in want), z.shape[-1]), dim=-1)
        values = values - log_total[want][:, None]
        for row, i in enumerate(want):
            n = seqs[i].params.top_logprobs
            seqs[i].next_top = list(zip(ids[row, :n].tolist(), values[row, :n].tolist()))

    def _sample_fused(self, logits, seqs, temps, u) -> tuple[list[int], list[float]]:
        tokens, logprobs, shift, log_total = self.fused(logits, temps, u)

        def shifted(want):
            t = torch.tensor([temps[i] if temps[i] > 0 else 1.0 for i in want])[:, None]
            return logits[want] / t - shift[want][:, None]
        self._top_logprobs(seqs, shifted, log_total)
        return tokens.tolist(), logprobs.tolist()

    def _uniforms(self, seqs: list[Sequence]) -> torch.Tensor:
        u = torch.rand(len(seqs), generator=self.generator)
        for i, s in enumerate(seqs):
            if s.generator is not None:
                u[i] = torch.rand(1, generator=s.generator)[0]
        return u

    @staticmethod
    def _truncate(weights: torch.Tensor, params) -> torch.Tensor:
        # weights: [batch, vocab], unnormalised probabilities; zero what top-k, top-p and min-p cut, per row
        probs = weights / weights.sum(dim=-1, keepdim=True)
        vocab = probs.shape[-1]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=probs.device)
        top_p = torch.tensor([p.top_p for p in params], device=probs.device)
        min_p = torch.tensor([p.min_p for p in params], device=probs.device)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=probs.device)[None, :]
        cut = rank >= top_k[:, None]
        cut |= (sorted_p.cumsum(dim=-1) - sorted_p) > top_p[:, None]   # keep the token that crosses p
        cut |= sorted_p < (min_p * sorted_p[:, 0])[:, None]
        sorted_p = sorted_p.masked_fill(cut, 0.0)
        return torch.zeros_like(probs).scatter_(1, order, sorted_p)
