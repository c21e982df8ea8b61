"""Train/inference agreement on real weights, as verl reports it (`rollout_corr/...`): the servers'
logprobs of the sampled tokens against the trainer's recompute of the same tokens, over the tokens the
trainer's own weights generated (per-token version == the trainer's version), so staleness is not
counted as disagreement. Taken before a step's first optimizer step changes the weights.

`kl`: the k3 estimate of KL(server || trainer) a token; `logprob_abs_diff_mean` / `_max`; `ppl_ratio`:
the trainer's perplexity of those tokens over the server's (1: the same); `tokens`: how many."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from trainer_bridge.training.grpo import kl_k3


class Agreement:
    def __init__(self) -> None:
        self.abs_sum = self.kl_sum = self.gap_sum = self.count = 0.0
        self.abs_max = 0.0

    def add(self, trainer: torch.Tensor, server: torch.Tensor, mask: torch.Tensor) -> None:
        """[rows, seq] each; `mask`: the tokens to compare (response tokens of the trainer's version)."""
        keep = mask.bool()
        if not keep.any():
            return
        t, s = trainer.detach()[keep].double(), server[keep].double()
        diff = (t - s).abs()
        self.abs_sum += float(diff.sum())
        self.abs_max = max(self.abs_max, float(diff.max()))
        self.kl_sum += float(kl_k3(s, t).sum())
        self.gap_sum += float((s - t).sum())
        self.count += float(keep.sum())

    def metrics(self, world: int = 1, device: torch.device | None = None) -> dict[str, float]:
        """Over every rank's tokens ({} when none was of the trainer's version)."""
        sums = torch.tensor([self.abs_sum, self.kl_sum, self.gap_sum, self.count], dtype=torch.float64, device=device)
        top = torch.tensor([self.abs_max], dtype=torch.float64, device=device)
        if world > 1:
            dist.all_reduce(sums)
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
        abs_sum, kl_sum, gap_sum, count = sums.tolist()
        if not count:
            return {}
        return {"rollout_corr/kl": kl_sum / count, "rollout_corr/logprob_abs_diff_mean": abs_sum / count,
                "rollout_corr/logprob_abs_diff_max": float(top[0]), "rollout_corr/ppl_ratio": math.exp(gap_sum / count),
                "rollout_corr/tokens": count}
