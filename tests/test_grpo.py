"""GRPO math on small hand-worked numbers."""

import math

import pytest
import torch

from trainer_bridge.training.grpo import (
    group_advantages,
    kl_k3,
    logprob_mismatch,
    policy_loss,
    sequence_logprobs,
)


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        atol=tol,
        rtol=0,
    )


# --- group_advantages -------------------------------------------------------------------------


def test_group_advantages_centre_and_scale_by_sample_std_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    # Group 1: mean 0.5, deviations +-0.5, sample std sqrt(4 * 0.25 / 3) = sqrt(1/3).
    # (The population std would be 0.5 and give exactly +-1.) Group 2 carries no signal: all 0.
    s = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # ~0.866
    close(group_advantages(rewards, group_size=4), [s, -s, -s, s, 0, 0, 0, 0])


def test_group_advantages_without_std_are_only_centred():
    rewards = torch.tensor([1, 0, 0, 1, 2, 2, 2, 2])  # ints are accepted
    close(group_advantages(rewards, group_size=4, normalize_std=False), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


def test_group_advantages_are_group_major():
    rewards = torch.tensor([0.0, 1.0, 10.0, 30.0])
    close(group_advantages(rewards, group_size=2, normalize_std=False), [-0.5, 0.5, -10.0, 10.0])


@pytest.mark.parametrize("count, group_size", [(7, 4), (4, 1)])
def test_group_advantages_reject_bad_group_size(count, group_size):
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(count), group_size=group_size)


# --- policy_loss ------------------------------------------------------------------------------


def clip_case():
    """Four sequences of two tokens; the second token of each is masked out with a wild ratio.

    First tokens, with clip range [0.8, 1.28]:
      r=1.5, A=+1: min(1.5, 1.28) = 1.28  -> loss -1.28, high clip binds (no gradient)
      r=1.5, A=-1: min(-1.5, -1.28) = -1.5 -> loss +1.5, unclipped
      r=0.5, A=+1: min(0.5, 0.8) = 0.5    -> loss -0.5, unclipped
      r=0.5, A=-1: min(-0.5, -0.8) = -0.8 -> loss +0.8, low clip binds (no gradient)
    """
    ratios = torch.tensor([[1.5, 50.0], [1.5, 50.0], [0.5, 0.01], [0.5, 0.01]], dtype=torch.float64)
    logprobs = ratios.log().requires_grad_()
    proximal_logprobs = torch.zeros_like(ratios)
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    loss_mask = torch.tensor([[1, 0], [1, 0], [1, 0], [1, 0]])
    return logprobs, proximal_logprobs, advantages, loss_mask


def test_policy_loss_clips_each_side_and_ignores_masked_tokens():
    logprobs, proximal_logprobs, advantages, loss_mask = clip_case()
    loss, metrics = policy_loss(logprobs, proximal_logprobs, advantages, loss_mask, clip_low=0.2, clip_high=0.28)

    close(loss, (-1.28 + 1.5 - 0.5 + 0.8) / 4)  # 0.13
    close(metrics["clip_fraction_high"], 0.25)
    close(metrics["clip_fraction_low"], 0.25)
    close(metrics["ratio_mean"], 1.0)
    close(metrics["approx_kl"], ((0.5 - math.log(1.5)) * 2 + (-0.5 - math.log(0.5)) * 2) / 4)
    assert "tis_weight_mean" not in metrics

    # d loss / d logprob = -r * A / 4 where unclipped, 0 where a clip binds or the token is masked.
    loss.backward()
    close(logprobs.grad, [[0, 0], [1.5 / 4, 0], [-0.5 / 4, 0], [0, 0]])


def test_policy_loss_accepts_per_token_advantages():
    logprobs, proximal_logprobs, advantages, loss_mask = clip_case()
    per_token = advantages.unsqueeze(-1).expand(-1, 2)
    loss, _ = policy_loss(logprobs, proximal_logprobs, per_token, loss_mask)
    close(loss, 0.13)


def test_aggregations_weigh_sequences_of_unequal_length_differently():
    # Ratio 1 everywhere, so each token's loss is -A. Sequence 0 has 1 token (loss -4),
    # sequence 1 has 3 tokens (loss -1 each), sequence 2 has none and must not count.
    logprobs = torch.zeros(3, 3)
    advantages = torch.tensor([[4.0, 9.0, 9.0], [1.0, 1.0, 1.0], [9.0, 9.0, 9.0]])
    loss_mask = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0]])

    token_mean, _ = policy_loss(logprobs, logprobs, advantages, loss_mask, agg="token-mean")
    seq_mean, _ = policy_loss(logprobs, logprobs, advantages, loss_mask, agg="seq-mean-token-mean")
    close(token_mean, (-4 - 1 - 1 - 1) / 4)  # -1.75
    close(seq_mean, (-4 + -1) / 2)  # -2.5


def test_all_masked_batch_gives_zero_loss_not_nan():
    logprobs = torch.zeros(2, 3, requires_grad=True)
    for agg in ["token-mean", "seq-mean-token-mean"]:
        loss, metrics = policy_loss(logprobs, logprobs.detach(), torch.ones(2), torch.zeros(2, 3), agg=agg)
        close(loss, 0.0)
        close(metrics["ratio_mean"], 0.0)


def test_unknown_agg_raises_naming_the_value():
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="token-sum"):
        policy_loss(lp, lp, torch.ones(1), torch.ones(1, 2), agg="token-sum")


def test_decoupled_weight_is_capped_detached_and_clip_stays_on_the_proximal_policy():
    # Ratio current/proximal = 1, A = 1. Weights proximal/behaviour: exp(0 - log 0.5) = 2 -> capped to 1.5,
    # and exp(0 - log 4) = 0.25. The current/behaviour ratios (2 and 0.25) lie outside the clip
    # range, yet nothing is clipped: the clip is centred on the proximal policy.
    logprobs = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    proximal_logprobs = torch.zeros(1, 2, dtype=torch.float64)
    behaviour_logprobs = torch.tensor([[math.log(0.5), math.log(4.0)]], dtype=torch.float64)
    loss, metrics = policy_loss(
        logprobs,
        proximal_logprobs,
        torch.ones(1, dtype=torch.float64),
        torch.ones(1, 2),
        behaviour_logprobs=behaviour_logprobs,
        tis_cap=1.5,
        off_policy="decoupled",
    )
    close(loss, -(1.5 + 0.25) / 2)
    close(metrics["tis_weight_mean"], (1.5 + 0.25) / 2)
    close(metrics["clip_fraction_low"], 0.0)
    close(metrics["clip_fraction_high"], 0.0)

    loss.backward()  # the weight scales the gradient but has none of its own
    close(logprobs.grad, [[-1.5 / 2, -0.25 / 2]])


def stale_tokens() -> dict:
    """Two tokens sampled one version back. Since then the trainer (proximal = current, one update
    a step) raised token 0 from p=0.25 to p=0.5 (ratio 2 against the behaviour policy) and left
    token 1 where it was; A = 1 for both."""
    return dict(logprobs=torch.full((1, 2), math.log(0.5), dtype=torch.float64, requires_grad=True),
                behaviour=torch.tensor([[math.log(0.25), math.log(0.5)]], dtype=torch.float64))


def test_behaviour_clip_stops_pushing_a_token_the_trainer_already_moved_past_the_clip():
    # The cause of async trailing sync (issue #30): stale samples kept pushing tokens the previous
    # updates had already pushed. Under decoupled PPO with one update a step nothing clips, so token 0
    # gets the full (capped) push; behaviour_clip gives it none and token 1 its on-policy gradient.
    t = stale_tokens()
    grads = {}
    for method in ("decoupled", "behaviour_clip"):
        lp = t["logprobs"].detach().clone().requires_grad_(True)
        loss, metrics = policy_loss(lp, lp.detach(), torch.ones(1, dtype=torch.float64), torch.ones(1, 2),
                                    behaviour_logprobs=t["behaviour"], tis_cap=2.0, off_policy=method)
        loss.backward()
        grads[method] = lp.grad
    close(grads["decoupled"], [[-2.0 / 2, -1.0 / 2]])
    close(grads["behaviour_clip"], [[0.0, -1.0 / 2]])


def test_behaviour_clip_is_the_default_and_plain_ppo_on_policy_and_dual_clips_negative_advantages():
    from trainer_bridge.config import TrainerConfig
    assert TrainerConfig().off_policy == "behaviour_clip"
    lp = torch.tensor([[math.log(0.5), math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    one = torch.ones(1, dtype=torch.float64)
    on_policy, _ = policy_loss(lp, lp.detach(), one, torch.ones(1, 2))
    clipped, _ = policy_loss(lp, lp.detach(), one, torch.ones(1, 2), behaviour_logprobs=lp.detach(), tis_cap=2.0)
    close(clipped, on_policy)
    # A = -1 on a token the trainer made 4x likelier since sampling: PPO's loss would be 4 * |A|,
    # the dual clip holds it at tis_cap * |A| = 2 (and stops its gradient)
    behaviour = torch.tensor([[math.log(0.125), math.log(0.5)]], dtype=torch.float64)
    loss, metrics = policy_loss(lp, lp.detach(), -torch.ones(1, dtype=torch.float64), torch.ones(1, 2),
                                behaviour_logprobs=behaviour, tis_cap=2.0)
    close(loss, (2.0 + 1.0) / 2)
    close(metrics["tis_truncated_frac"], 0.5)


def test_icepop_masks_tokens_whose_weight_is_out_of_band():
    # weights exp(proximal - behaviour): 4 (above tis_cap 2), 1 (in band), 0.25 (below 0.5)
    lp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    behaviour = torch.tensor([[math.log(0.25), 0.0, math.log(4.0)]], dtype=torch.float64)
    loss, metrics = policy_loss(lp, lp.detach(), torch.ones(1, dtype=torch.float64), torch.ones(1, 3),
                                behaviour_logprobs=behaviour, tis_cap=2.0, off_policy="icepop", is_band_low=0.5)
    loss.backward()
    close(lp.grad, [[0.0, -1.0 / 3, 0.0]])
    close(metrics["is_masked_frac"], 2 / 3)
    with pytest.raises(ValueError, match="is_band_low"):
        policy_loss(lp, lp.detach(), torch.ones(1), torch.ones(1, 3), behaviour_logprobs=behaviour, tis_cap=2.0,
                    off_policy="icepop", is_band_low=1.5)


@pytest.mark.parametrize("with_behaviour, tis_cap", [(True, None), (False, 2.0)])
def test_behaviour_logprobs_and_tis_cap_go_together(with_behaviour, tis_cap):
    lp = torch.zeros(1, 2)
    behaviour = lp if with_behaviour else None
    with pytest.raises(ValueError, match="tis_cap"):
        policy_loss(lp, lp, torch.ones(1), torch.ones(1, 2), behaviour_logprobs=behaviour, tis_cap=tis_cap)


def test_policy_loss_names_the_misshaped_tensor():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="loss_mask"):
        policy_loss(lp, lp, torch.ones(2), torch.ones(2, 4))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(lp, lp, torch.ones(3), torch.ones(2, 3))


# --- KL and mismatch --------------------------------------------------------------------------


def test_kl_k3_is_zero_at_equal_logprobs_and_matches_hand_value():
    lp = torch.tensor([[-0.3, -2.0, -7.0]])
    close(kl_k3(lp, lp), [[0.0, 0.0, 0.0]])
    # lp = 0, ref = log 2: 2 - log 2 - 1; lp = log 2, ref = 0: 0.5 + log 2 - 1.
    lp, ref = torch.tensor([0.0, math.log(2)]), torch.tensor([math.log(2), 0.0])
    close(kl_k3(lp, ref), [1 - math.log(2), math.log(2) - 0.5])


def test_logprob_mismatch_over_masked_tokens():
    trainer = torch.tensor([[0.0, -1.0, -5.0]])
    inference = torch.tensor([[0.0, -2.0, 0.0]])
    loss_mask = torch.tensor([[1, 1, 0]])  # the third token's large gap must not count
    mismatch = logprob_mismatch(trainer, inference, loss_mask)
    close(mismatch["mean_abs_diff"], (0 + 1) / 2)
    # k3 of KL(inference || trainer), log ratio trainer - inference = [0, 1]: (0 + (e - 1 - 1)) / 2
    close(mismatch["kl_k3"], (math.e - 2) / 2)


# --- sequence_logprobs ------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sequence_logprobs_match_a_loop_reference(temperature):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=generator, dtype=torch.float64) * 4
    input_ids = torch.randint(0, 11, (3, 5), generator=generator)

    expected = torch.empty(3, 4, dtype=torch.float64)
    for b in range(3):
        for t in range(4):
            expected[b, t] = torch.log_softmax(logits[b, t] / temperature, dim=-1)[input_ids[b, t + 1]]

    actual = sequence_logprobs(logits, input_ids, temperature=temperature)
    assert actual.shape == (3, 4)
    close(actual, expected, tol=1e-10)


def test_sequence_logprobs_upcast_half_precision_and_carry_gradient():
    logits = torch.randn(2, 4, 7, generator=torch.Generator().manual_seed(1))
    logits = logits.to(torch.bfloat16).requires_grad_()
    input_ids = torch.tensor([[1, 2, 3, 4], [6, 5, 0, 1]])
    actual = sequence_logprobs(logits, input_ids)
    assert actual.dtype == torch.float32
    log_softmax = torch.log_softmax(logits.float()[:, :-1], dim=-1)
    expected = log_softmax.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    close(actual, expected)

    actual.sum().backward()
    assert logits.grad is not None
    assert logits.grad[:, -1].abs().sum() == 0  # the last position predicts no token


def test_sequence_logprobs_reject_bad_temperature():
    with pytest.raises(ValueError, match="temperature"):
        sequence_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), temperature=0.0)
