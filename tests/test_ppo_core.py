"""The PPO math against numbers worked out by hand (the working is in the comments)."""

import math

import pytest
import torch

from rlhflow.models.logits import entropy_from_logits, logprobs_from_logits
from rlhflow.ppo import core

approx = lambda x, **kw: pytest.approx(x, abs=kw.pop("abs", 1e-5), **kw)  # noqa: E731


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_masked_mean_and_var_ignore_padding():
    x, mask = t([[1.0, 2.0, 3.0, 100.0]]), t([[1, 1, 1, 0]])
    assert core.masked_mean(x, mask).item() == approx(2.0)
    # (1 + 0 + 1) / (3 - 1) = 1
    assert core.masked_var(x, mask).item() == approx(1.0)
    assert core.masked_var(x, mask, unbiased=False).item() == approx(2 / 3)
    assert core.masked_mean(t([[1.0, 3.0], [5.0, 0.0]]), t([[1, 1], [1, 0]]), dim=1).tolist() == [2.0, 5.0]


def test_whiten_by_hand():
    # mean 2.5, unbiased var (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3, std 1.290994
    w = core.masked_whiten(t([1.0, 2.0, 3.0, 4.0]), t([1, 1, 1, 1]))
    assert w.tolist() == approx([-1.161895, -0.387298, 0.387298, 1.161895])
    # padding neither counts nor survives: mean 2, var (1 + 0 + 1) / 2 = 1
    w = core.masked_whiten(t([1.0, 2.0, 3.0, 100.0]), t([1, 1, 1, 0]))
    assert w.tolist() == approx([-1.0, 0.0, 1.0, 0.0])
    # shift_mean=False rescales but keeps the mean: [-1, 0, 1] + 2
    w = core.masked_whiten(t([1.0, 2.0, 3.0]), t([1, 1, 1]), shift_mean=False)
    assert w.tolist() == approx([1.0, 2.0, 3.0])


def test_kl_estimators_by_hand():
    logp, ref = t([-1.0, -2.0]), t([-1.5, -1.0])
    # k1 = logp - ref
    assert core.kl_per_token(logp, ref, "k1").tolist() == approx([0.5, -1.0])
    # log r = ref - logp = [-0.5, 1.0]; k3 = r - 1 - log r
    #   e^-0.5 - 1 + 0.5 = 0.606531 - 0.5 = 0.106531;  e - 1 - 1 = 0.718282
    assert core.kl_per_token(logp, ref, "k3").tolist() == approx([0.106531, 0.718282])
    assert core.kl_per_token(ref, ref, "k3").tolist() == [0.0, 0.0]
    with pytest.raises(ValueError):
        core.kl_per_token(logp, ref, "k2")


def test_per_token_rewards_put_score_on_last_real_token():
    scores = t([2.0, -1.0])
    kl = t([[0.1, 0.2, 0.3], [0.5, 0.5, 9.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    r = core.per_token_rewards(scores, kl, 0.1, mask)
    # row 0: -0.1 * kl, + 2 on token 2;  row 1: -0.1 * kl, -1 on token 1, padding 0
    assert r.tolist()[0] == approx([-0.01, -0.02, 1.97])
    assert r.tolist()[1] == approx([-0.05, -1.05, 0.0])


def test_missing_eos_penalty_only_on_rows_that_did_not_end():
    scores, ended = t([1.0, 2.0, 3.0]), torch.tensor([True, False, True])
    assert core.penalize_missing_eos(scores, ended, 0.5).tolist() == [1.0, 1.5, 3.0]
    assert core.penalize_missing_eos(scores, ended, None).tolist() == [1.0, 2.0, 3.0]


def test_overlong_shaping_by_hand():
    lengths = torch.tensor([10, 40, 45, 48])
    # limit 48, buffer 8: nothing up to 40 tokens, then a linear fall to -penalty at 48
    torch.testing.assert_close(core.overlong_penalty(lengths, 48, 8, 0.5), torch.tensor([0.0, 0.0, -0.5 * 5 / 8, -0.5]))
    assert core.overlong_penalty(lengths, 48, 0, 0.5).abs().sum() == 0  # buffer 0: off


def test_token_and_sequence_means_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert float(core.aggregate(x, mask, "token_mean")) == (1 + 2 + 3 + 4) / 4
    assert float(core.aggregate(x, mask, "sequence_mean")) == ((1 + 2 + 3) / 3 + 4) / 2  # the empty row counts not
    assert (
        float(core.aggregation_units(mask, "token_mean")) == 4
        and float(core.aggregation_units(mask, "sequence_mean")) == 2
    )
    # the clipped losses take the aggregation: a sequence mean weighs the one-token answer as much as the long one
    logprobs, old = torch.zeros(3, 4), torch.zeros(3, 4)
    loss, _, _ = core.policy_loss(logprobs, old, x, mask, 0.2, "sequence_mean")
    assert float(loss) == -3.0
    value, _ = core.value_loss(torch.zeros(3, 4), torch.zeros(3, 4), x, mask, None, "sequence_mean")
    assert float(value) == pytest.approx(0.5 * ((1 + 4 + 9) / 3 + 16) / 2)


def test_gae_by_hand():
    gamma, lam = 0.9, 0.5  # gamma * lam = 0.45
    rewards = t([[1.0, 0.0, 2.0], [0.5, 1.0, 9.0]])
    values = t([[0.5, 1.0, 0.0], [0.2, 0.4, 7.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = core.gae(rewards, values, mask, gamma, lam)
    # row 0:  t=2: delta = 2 + 0.9*0 - 0 = 2            A = 2
    #         t=1: delta = 0 + 0.9*0 - 1 = -1           A = -1 + 0.45*2 = -0.1
    #         t=0: delta = 1 + 0.9*1 - 0.5 = 1.4        A = 1.4 + 0.45*(-0.1) = 1.355
    assert adv[0].tolist() == approx([1.355, -0.1, 2.0])
    assert ret[0].tolist() == approx([1.855, 0.9, 2.0])  # A + V
    # row 1 ends at t=1 (V after it is 0; the padded 9 and 7 are ignored):
    #         t=1: delta = 1 + 0 - 0.4 = 0.6           A = 0.6
    #         t=0: delta = 0.5 + 0.9*0.4 - 0.2 = 0.66  A = 0.66 + 0.45*0.6 = 0.93
    assert adv[1].tolist() == approx([0.93, 0.6, 0.0])
    assert ret[1].tolist() == approx([1.13, 1.0, 0.0])


def test_gae_lambda_one_gamma_one_is_reward_to_go_minus_value():
    rewards, values, mask = t([[1.0, 2.0, 3.0]]), t([[0.5, 0.5, 0.5]]), t([[1, 1, 1]])
    adv, ret = core.gae(rewards, values, mask, 1.0, 1.0)
    assert ret[0].tolist() == approx([6.0, 5.0, 3.0])
    assert adv[0].tolist() == approx([5.5, 4.5, 2.5])


def test_clipped_policy_loss_by_hand():
    eps = 0.2
    ratios = [1.5, 0.5, 0.5, 1.1, 7.0]
    adv = t([[1.0, 2.0, -1.0, -3.0, 100.0]])
    mask = t([[1, 1, 1, 1, 0]])  # the last token is padding
    old = t([[-1.0] * 5])
    new = old + torch.log(t([ratios]))
    loss, clipfrac, approxkl = core.policy_loss(new, old, adv, mask, eps)
    # per token max(-rho A, -clip(rho) A):
    #   rho 1.5, A  1: max(-1.5, -1.2) = -1.2   (clipped term active)
    #   rho 0.5, A  2: max(-1.0, -1.6) = -1.0
    #   rho 0.5, A -1: max( 0.5,  0.8) =  0.8   (clipped term active)
    #   rho 1.1, A -3: max( 3.3,  3.3) =  3.3
    assert loss.item() == approx((-1.2 - 1.0 + 0.8 + 3.3) / 4)  # 0.475
    assert clipfrac.item() == approx(0.5)
    # 0.5 * mean(log r ^ 2): logs 0.405465, -0.693147, -0.693147, 0.095310
    #   squares 0.164402 + 0.480453 + 0.480453 + 0.009084 = 1.134392 -> 0.5 * 1.134392 / 4
    assert approxkl.item() == approx(0.141799)


def test_policy_loss_gradient_is_zero_when_clipped():
    old = t([[0.0, 0.0]])
    new = torch.log(t([[1.5, 1.05]])).requires_grad_(True)  # first ratio outside 1 +- 0.2, second inside
    loss, _, _ = core.policy_loss(new, old, t([[1.0, 1.0]]), t([[1, 1]]), 0.2)
    loss.backward()
    # d/dlogp of -rho*A/2 = -rho/2 for the unclipped token; 0 for the clipped one
    assert new.grad.tolist()[0] == approx([0.0, -0.525])


def test_clipped_value_loss_by_hand():
    values, old, returns = t([[1.0, 0.0, 2.0, 50.0]]), t([[0.5, 0.5, 2.0, 0.0]]), t([[2.0, -1.0, 0.0, 0.0]])
    mask = t([[1, 1, 1, 0]])
    loss, clipfrac = core.value_loss(values, old, returns, mask, 0.2)
    #   V 1, old .5, R 2:  (1-2)^2 = 1;  V_clip = .5 + .2 = .7, (.7-2)^2 = 1.69  -> 1.69 (clipped)
    #   V 0, old .5, R -1: (0+1)^2 = 1;  V_clip = .5 - .2 = .3, (.3+1)^2 = 1.69  -> 1.69 (clipped)
    #   V 2, old 2,  R 0:  4;            V_clip = 2, 4                           -> 4
    assert loss.item() == approx(0.5 * (1.69 + 1.69 + 4.0) / 3)  # 1.23
    assert clipfrac.item() == approx(2 / 3)
    unclipped, frac = core.value_loss(values, old, returns, mask, None)
    assert unclipped.item() == approx(0.5 * (1 + 1 + 4) / 3) and frac.item() == 0.0


def test_entropy_and_logprobs_from_logits():
    assert entropy_from_logits(torch.zeros(2, 4)).tolist() == approx([math.log(4)] * 2)
    # a distribution (1/2, 1/4, 1/4): H = 1.5 log 2
    logits = torch.log(t([[0.5, 0.25, 0.25]]))
    assert entropy_from_logits(logits).item() == approx(1.5 * math.log(2))
    logits = torch.randn(3, 5, 7)
    tokens = torch.randint(0, 7, (3, 5))
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    assert torch.allclose(logprobs_from_logits(logits, tokens), expected, atol=1e-6)


def test_adaptive_kl_controller_moves_towards_target():
    ctl = core.AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    ctl.update(12.0, n_steps=16)  # e = clip(12/6 - 1) = 0.2: beta * (1 + 0.2 * 16 / 10000)
    assert ctl.value == approx(0.1 * 1.00032, abs=1e-9)
    ctl = core.AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    ctl.update(3.0, n_steps=16)  # e = clip(-0.5) = -0.2
    assert ctl.value == approx(0.1 * 0.99968, abs=1e-9)
    ctl = core.AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    ctl.update(6.6, n_steps=16)  # e = 0.1, inside the clip
    assert ctl.value == approx(0.1 * 1.00016, abs=1e-9)
    # repeated: above target beta keeps growing, below it keeps shrinking
    up, down = core.AdaptiveKLController(0.1, 6.0, 100), core.AdaptiveKLController(0.1, 6.0, 100)
    for _ in range(10):
        up.update(10.0, 16)
        down.update(1.0, 16)
    assert up.value > 0.1 * 1.3 and down.value < 0.1 * 0.75
    restored = core.AdaptiveKLController(0.5, 6.0, 100)
    restored.load_state_dict(up.state_dict())
    assert restored.value == up.value


def test_fixed_kl_controller():
    ctl = core.FixedKLController(0.05)
    ctl.update(100.0, 16)
    assert ctl.value == 0.05
    other = core.FixedKLController(1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


def test_running_moments_match_the_whole_sample():
    rm = core.RunningMoments()
    assert rm.std == 1.0  # nothing seen yet
    rm.update(t([1.0, 2.0, 3.0]))
    rm.update(t([4.0, 5.0]))
    # 1..5: mean 3, population variance 2
    assert rm.mean == approx(3.0) and rm.var == approx(2.0) and rm.count == 5
    assert rm.normalize(t([3.0, 3.0 + math.sqrt(2)])).tolist() == approx([0.0, 1.0])
    copy = core.RunningMoments()
    copy.load_state_dict(rm.state_dict())
    assert (copy.mean, copy.var, copy.count) == (rm.mean, rm.var, rm.count)


def test_explained_variance_is_one_for_a_perfect_critic_and_zero_for_the_mean():
    returns = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float)
    assert core.explained_variance(returns.clone(), returns, mask).item() == pytest.approx(1.0)
    mean = core.masked_mean(returns, mask)
    assert core.explained_variance(torch.full_like(returns, mean.item()), returns, mask).item() == pytest.approx(0.0)
    assert core.explained_variance(-returns, returns, mask).item() < 0  # worse than the mean
