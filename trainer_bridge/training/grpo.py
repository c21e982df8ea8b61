"""GRPO math as pure functions: advantages, the clipped policy loss, KL estimators, logprobs.

Conventions shared by every function here:
- Per-token tensors are `[batch, seq]`, aligned with the response tokens; `loss_mask` is 1 where a
  token counts (sampled by the policy) and 0 for padding and tool/environment tokens.
- Metrics are detached 0-d tensors, so logging them costs no device sync until the caller asks.
- Every mean over tokens divides by the count clamped to 1: an all-masked batch gives 0, not NaN.

Off-policy data. Three policies meet in an asynchronous step:
- behaviour: the inference server's weights that sampled the tokens (`behaviour_logprobs`, returned
  by the server);
- proximal: the trainer's weights before this step, recomputed by the trainer
  (`proximal_logprobs`, PPO's "old" policy);
- current: the weights being optimised (`logprobs`, with grad).
In verl/slime naming `old_log_prob` is the proximal and `rollout_log_probs` the behaviour; in AReaL's
`prox_logp` is the proximal and `old_logp` the behaviour. `policy_loss` corrects for the gap
between behaviour and current one of three ways (`OffPolicy`, `trainer.off_policy`):
- `behaviour_clip` (the default): PPO's clipped ratio taken against the behaviour policy,
  exp(logprobs - behaviour_logprobs), so the trust region is centred on the weights that sampled
  the data. A token whose probability the trainer has already moved past the clip since it was
  sampled (up, with A > 0; down, with A < 0) gets no further push from these stale samples; the
  ratio is the importance weight everywhere else. Dual-clipped at `tis_cap` for A < 0. On
  on-policy data (sync) it is plain PPO; with ppo_epochs > 1 the clip bounds the whole move
  from the behaviour policy.
- `decoupled`: AReaL's decoupled PPO / truncated importance sampling: the clip is centred on the
  proximal policy and each token's loss is multiplied by the detached weight
  min(exp(proximal - behaviour), tis_cap). With one update a step the proximal is the current
  policy, so nothing is ever clipped and stale tokens are pushed as hard as fresh ones.
- `icepop`: `decoupled`, with tokens whose weight exp(proximal - behaviour) falls outside
  [is_band_low, tis_cap] masked from the loss (IcePop) instead of truncated.
Why `behaviour_clip` is the default: bench/e2e.py (docs/configuration.md, "Off-policy correction").
"""

from collections.abc import Callable

import torch
from torch import Tensor

from trainer_bridge.config import OffPolicy


def group_advantages(
    rewards: Tensor,  # [num_groups * group_size], group-major: group g is rewards[g*n:(g+1)*n]
    group_size: int,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:  # [num_groups * group_size]
    """Mean-centre rewards within each group; with `normalize_std`, divide by (group std + eps).

    The std is the sample std (Bessel's correction, divide by n - 1), as TRL, verl and OpenRLHF
    compute it, so advantages match what users see there. A group whose rewards are all equal
    gets advantages of 0.
    """
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: a GRPO group needs at least 2 samples for a baseline")
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards has shape {tuple(rewards.shape)}; expected one dim of num_groups * group_size "
            f"(group_size={group_size})"
        )
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    grouped = rewards.view(-1, group_size)  # [num_groups, group_size]
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (grouped.std(dim=1, correction=1, keepdim=True) + eps)
    return centred.view(-1)


def kl_k3(
    logprobs: Tensor,  # [batch, seq] policy that sampled the tokens
    ref_logprobs: Tensor,  # [batch, seq]
) -> Tensor:  # [batch, seq]
    """Schulman's k3 estimator of KL(policy || ref), per token: exp(ref - lp) - (ref - lp) - 1.

    Unbiased when the tokens were sampled from `logprobs`' policy, and never negative.
    """
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def token_mean(
    values: Tensor,  # [batch, seq]
    mask: Tensor,  # [batch, seq], float 0/1
) -> Tensor:  # []
    """Sum over all masked tokens / number of masked tokens: long sequences weigh more."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def seq_mean_token_mean(
    values: Tensor,  # [batch, seq]
    mask: Tensor,  # [batch, seq], float 0/1
) -> Tensor:  # []
    """Mean over tokens within each sequence, then over sequences with at least one masked token."""
    tokens_per_seq = mask.sum(dim=1)  # [batch]
    per_seq = (values * mask).sum(dim=1) / tokens_per_seq.clamp(min=1)  # [batch]
    has_tokens = (tokens_per_seq > 0).to(values.dtype)  # [batch]
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1)


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
}


def aggregate(values: Tensor, mask: Tensor, agg: str) -> Tensor:
    """Reduce per-token `values` [batch, seq] over `mask` with the aggregation named `agg`."""
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg={agg!r} is not one of {sorted(AGGREGATIONS)}")
    return AGGREGATIONS[agg](values, mask)


def policy_loss(
    logprobs: Tensor,  # [batch, seq] current policy, with grad
    proximal_logprobs: Tensor,  # [batch, seq] proximal policy: trainer weights before this step
    advantages: Tensor,  # [batch] per sequence, or [batch, seq] per token
    loss_mask: Tensor,  # [batch, seq] 1 = token counts
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    agg: str = "token-mean",
    behaviour_logprobs: Tensor | None = None,  # [batch, seq] from the inference server
    tis_cap: float | None = None,
    off_policy: OffPolicy | str = OffPolicy.behaviour_clip,
    is_band_low: float = 0.5,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped objective per token with separate low/high clip (DAPO clip-higher).

    On-policy (no `behaviour_logprobs`): loss_t = -min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A),
    r_t = exp(lp - proximal). With `behaviour_logprobs` and `tis_cap` (pass both; tis_cap=inf for
    no cap), by `off_policy` (module docstring):
    - behaviour_clip: the same with r_t = exp(lp - behaviour), and for A < 0 at most -tis_cap * A;
    - decoupled: the on-policy loss times w_t = min(exp(proximal - behaviour), tis_cap), detached;
    - icepop: the on-policy loss times w_t, and 0 where exp(proximal - behaviour) is outside
      [is_band_low, tis_cap].

    Metrics are token means over masked tokens, whatever `agg` is. A clip fraction counts tokens
    where that clip binds (zeroes the gradient): r < 1 - clip_low with A < 0, r > 1 + clip_high
    with A > 0, for the ratio the clip acts on. `approx_kl` is k3 of KL(proximal || current),
    `ratio_mean` the mean of exp(lp - proximal). With behaviour logprobs: `tis_weight_mean` (the
    weight w_t as applied: masked tokens count 0), `tis_truncated_frac` (tokens whose
    exp(proximal - behaviour) exceeds tis_cap), `is_masked_frac` (tokens icepop masks; the share
    outside the band under the other methods, which do not mask).
    """
    off_policy = OffPolicy(off_policy)
    check_loss_args(agg, clip_low, clip_high, behaviour_logprobs, tis_cap, is_band_low)
    check_same_shape(
        logprobs, proximal_logprobs=proximal_logprobs, loss_mask=loss_mask, behaviour_logprobs=behaviour_logprobs
    )
    advantages = per_token_advantages(advantages, logprobs)  # [batch, seq] or [batch, 1]
    mask = loss_mask.to(logprobs.dtype)  # [batch, seq]

    log_ratio = logprobs - proximal_logprobs  # [batch, seq]
    ratio = torch.exp(log_ratio)
    against_behaviour = behaviour_logprobs is not None and off_policy is OffPolicy.behaviour_clip
    clip_ratio = torch.exp(logprobs - behaviour_logprobs) if against_behaviour else ratio
    clipped = torch.clamp(clip_ratio, 1 - clip_low, 1 + clip_high)
    per_token = -torch.minimum(clip_ratio * advantages, clipped * advantages)  # [batch, seq]

    metrics: dict[str, Tensor] = {}
    if behaviour_logprobs is not None:
        per_token, metrics = off_policy_correction(per_token, proximal_logprobs, behaviour_logprobs, advantages,
                                                   mask, off_policy, tis_cap, is_band_low)

    with torch.no_grad():
        clipped_low = ((clip_ratio < 1 - clip_low) & (advantages < 0)).to(mask.dtype)
        clipped_high = ((clip_ratio > 1 + clip_high) & (advantages > 0)).to(mask.dtype)
        metrics["clip_fraction_low"] = token_mean(clipped_low, mask)
        metrics["clip_fraction_high"] = token_mean(clipped_high, mask)
        metrics["approx_kl"] = token_mean(ratio - 1 - log_ratio, mask)
        metrics["ratio_mean"] = token_mean(ratio, mask)
    return AGGREGATIONS[agg](per_token, mask), metrics


def check_loss_args(agg: str, clip_low: float, clip_high: float, behaviour_logprobs: Tensor | None,
                    tis_cap: float | None, is_band_low: float) -> None:
    """policy_loss's arguments that are wrong whatever the tensors, named."""
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg={agg!r} is not one of {sorted(AGGREGATIONS)}")
    if not 0 <= clip_low < 1 or clip_high < 0:
        raise ValueError(
            f"clip_low={clip_low}, clip_high={clip_high}: need 0 <= clip_low < 1 and clip_high >= 0"
        )
    if (behaviour_logprobs is None) != (tis_cap is None):
        raise ValueError(
            "pass behaviour_logprobs and tis_cap together (tis_cap=float('inf') for untruncated "
            "importance sampling), or neither for on-policy data"
        )
    if tis_cap is not None and not 0 <= is_band_low < 1 < tis_cap:
        raise ValueError(f"is_band_low={is_band_low}, tis_cap={tis_cap}: need 0 <= is_band_low < 1 < tis_cap")


def off_policy_correction(
    per_token: Tensor,  # [batch, seq] the clipped loss, its ratio taken as `off_policy` says
    proximal_logprobs: Tensor,  # [batch, seq]
    behaviour_logprobs: Tensor,  # [batch, seq]
    advantages: Tensor,  # [batch, seq] or [batch, 1]
    mask: Tensor,  # [batch, seq] float
    off_policy: OffPolicy,
    tis_cap: float,
    is_band_low: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token loss corrected for the behaviour policy (policy_loss's docstring), and the
    weight metrics."""
    raw = torch.exp(proximal_logprobs - behaviour_logprobs).detach()  # [batch, seq]
    outside = (raw < is_band_low) | (raw > tis_cap)
    weight = raw.clamp(max=tis_cap)
    if off_policy is OffPolicy.behaviour_clip:      # dual clip: a negative advantage costs at most tis_cap * |A|
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -tis_cap * advantages), per_token)
    else:
        if off_policy is OffPolicy.icepop:
            weight = weight.masked_fill(outside, 0.0)
        per_token = per_token * weight
    return per_token, {"tis_weight_mean": token_mean(weight, mask),
                       "tis_truncated_frac": token_mean((raw > tis_cap).to(mask.dtype), mask),
                       "is_masked_frac": token_mean(outside.to(mask.dtype), mask)}


def per_token_advantages(
    advantages: Tensor,  # [batch] or [batch, seq]
    logprobs: Tensor,  # [batch, seq]
) -> Tensor:  # [batch, 1] (broadcasts over tokens) or [batch, seq]
    if advantages.shape == logprobs.shape[:1]:
        return advantages.unsqueeze(-1)
    if advantages.shape == logprobs.shape:
        return advantages
    raise ValueError(
        f"advantages has shape {tuple(advantages.shape)}; expected [batch] or [batch, seq] = "
        f"{tuple(logprobs.shape)}"
    )


def check_same_shape(reference: Tensor, **tensors: Tensor | None) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != reference.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected {tuple(reference.shape)}")


def logprob_mismatch(
    trainer_logprobs: Tensor,  # [batch, seq]
    inference_logprobs: Tensor,  # [batch, seq]
    loss_mask: Tensor,  # [batch, seq]
) -> dict[str, Tensor]:
    """How far the trainer's logprobs of the sampled tokens are from the server's, over masked tokens.

    `mean_abs_diff`: mean |trainer - inference|. `kl_k3`: k3 estimate of KL(inference || trainer),
    the direction the samples (drawn by the server) estimate without bias.
    """
    check_same_shape(trainer_logprobs, inference_logprobs=inference_logprobs, loss_mask=loss_mask)
    with torch.no_grad():
        mask = loss_mask.to(trainer_logprobs.dtype)
        return {
            "mean_abs_diff": token_mean((trainer_logprobs - inference_logprobs).abs(), mask),
            "kl_k3": token_mean(kl_k3(inference_logprobs, trainer_logprobs), mask),
        }


def sequence_logprobs(
    logits: Tensor,  # [batch, seq, vocab] causal LM output over input_ids
    input_ids: Tensor,  # [batch, seq]
    temperature: float = 1.0,
) -> Tensor:  # [batch, seq - 1], float32 or wider
    """Logprob of each next token: log_softmax(logits[:, :-1] / temperature) at input_ids[:, 1:].

    Works one sequence at a time in float32 (or the logits' dtype, if wider) as logit - logsumexp,
    so the forward pass holds one sequence's copy of the vocab-sized logits, never a full
    [batch, seq, vocab] log-softmax; autograd keeps at most one full float32 copy for backward.
    """
    return sequence_logprobs_and_entropy(logits, input_ids, temperature, entropy=False)[0]


def sequence_logprobs_and_entropy(
    logits: Tensor,  # [batch, seq, vocab]
    input_ids: Tensor,  # [batch, seq]
    temperature: float = 1.0,
    entropy: bool = True,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:  # [batch, seq - 1] each
    """`sequence_logprobs`, and with `entropy` the entropy of each of those next-token
    distributions from the same scaled logits and logsumexp (one pass over the vocab-sized rows).
    The entropy carries gradient only with `entropy_grad` (an entropy bonus in the loss)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"logits has shape {tuple(logits.shape)} and input_ids {tuple(input_ids.shape)}; "
            "expected [batch, seq, vocab] and [batch, seq]"
        )
    dtype = torch.promote_types(logits.dtype, torch.float32)
    targets = input_ids[:, 1:]  # [batch, seq - 1]
    rows, entropies = [], []
    for row_logits, row_targets in zip(logits[:, :-1], targets):  # [seq - 1, vocab], [seq - 1]
        scaled = row_logits.to(dtype) / temperature
        target_logits = scaled.gather(-1, row_targets.unsqueeze(-1)).squeeze(-1)  # [seq - 1]
        lse = torch.logsumexp(scaled, dim=-1)  # [seq - 1]
        rows.append(target_logits - lse)
        if entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                # H = logsumexp - sum(p * scaled), p = softmax(scaled)
                entropies.append(lse - (torch.exp(scaled - lse.unsqueeze(-1)) * scaled).sum(-1))
    return torch.stack(rows), (torch.stack(entropies) if entropy else None)


def overlong_penalty(
    lengths: Tensor,  # [batch] response tokens
    max_new_tokens: int,
    buffer: int,
    penalty: float = 1.0,
) -> Tensor:  # [batch], <= 0
    """DAPO's soft overlong punishment: 0 up to max_new_tokens - buffer, then falling linearly to
    -penalty at max_new_tokens (and below it past that)."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    start = max_new_tokens - buffer
    return -penalty * (lengths.to(torch.float32) - start).clamp(min=0) / buffer
