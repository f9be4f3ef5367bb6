"""The PPO math as pure tensor functions (no models, no I/O).

Shapes: B responses of T response tokens. `mask` is 1 on real response tokens (up to and including EOS or the
token that completed a stop string) and 0 on the right padding after them. Every function that reduces over
tokens takes that mask, so padding never counts.

References: Ziegler et al. 2019 (adaptive KL), Schulman et al. 2016 (GAE), Schulman et al. 2017 (PPO),
Huang et al. 2024 ("The N+ implementation details of RLHF with PPO"), Schulman's "Approximating KL
divergence" note (k1/k3 estimators).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch

# the per-token KL estimators live with the other logit math (evaluation measures KL too); PPO uses them from here
from rlhflow.models.logits import kl_per_token as kl_per_token

# ---- masked statistics ---------------------------------------------------------------------------


SumAcross = Callable[[torch.Tensor], torch.Tensor]


def masked_mean(
    x: torch.Tensor,
    mask: torch.Tensor,
    dim: int | None = None,
    sum_across: SumAcross | None = None,
) -> torch.Tensor:
    """Mean of x over the positions where mask is 1 (over all of them, or along `dim`). `sum_across` sums a
    tensor over data-parallel processes (rlhflow.training.distributed.sum_across), making the mean one over the global
    batch; None: this process's tensors only."""
    mask = mask.to(x.dtype)
    if dim is None:
        total, count = (x * mask).sum(), mask.sum()
        if sum_across is not None:
            total, count = sum_across(torch.stack([total, count]))
        return total / count.clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def masked_var(
    x: torch.Tensor,
    mask: torch.Tensor,
    unbiased: bool = True,
    sum_across: SumAcross | None = None,
) -> torch.Tensor:
    """Variance of x over the masked positions; unbiased (n-1) by default. `sum_across`: as in masked_mean."""
    mean = masked_mean(x, mask, sum_across=sum_across)
    centered_sq = (x - mean) ** 2
    var = masked_mean(centered_sq, mask, sum_across=sum_across)
    if unbiased:
        n = mask.sum() if sum_across is None else sum_across(mask.to(x.dtype).sum())
        if n < 2:
            return torch.zeros_like(var)
        var = var * n / (n - 1)
    return var


def explained_variance(
    values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, sum_across: SumAcross | None = None
) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns) over the masked tokens: 1 for a critic that predicts the returns,
    0 for one no better than their mean, negative for a worse one (the critic's health, as CleanRL logs it)."""
    var_returns = masked_var(returns, mask, sum_across=sum_across)
    return 1 - masked_var(returns - values, mask, sum_across=sum_across) / var_returns.clamp(min=1e-12)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8, sum_across: SumAcross | None = None
) -> torch.Tensor:
    """(x - mean) / std over the masked positions; padding stays 0. shift_mean=False keeps the mean
    (only rescales), as used for rewards by some implementations. `sum_across`: global statistics, as in
    masked_mean."""
    mean, var = masked_mean(x, mask, sum_across=sum_across), masked_var(x, mask, sum_across=sum_across)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(x.dtype)


# ---- KL to the reference and per-token rewards ---------------------------------------------------


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real token of each (right-padded) row: where the reward model's score goes."""
    return (mask.sum(dim=1).long() - 1).clamp(min=0)


def penalize_missing_eos(scores: torch.Tensor, ended: torch.Tensor, penalty: float | None) -> torch.Tensor:
    """score - penalty for every response that never emitted EOS or a stop string (None: no penalty)."""
    if penalty is None:
        return scores
    return scores - penalty * (~ended.bool()).to(scores.dtype)


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's overlong reward shaping (Yu et al. 2025, arXiv 2503.14476), added to the score: 0 for a response of at
    most max_length - buffer tokens, then falling linearly to -penalty at max_length,
        -penalty * clip((|y| - (max_length - buffer)) / buffer, 0, 1);
    buffer 0: no shaping."""
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    over = (lengths.float() - (max_length - buffer)) / buffer
    return -penalty * over.clamp(0.0, 1.0)


def per_token_rewards(scores: torch.Tensor, kl: torch.Tensor, kl_coef: float, mask: torch.Tensor) -> torch.Tensor:
    """r_t = -beta * kl_t on every real token, plus the sequence score on the last real token."""
    rewards = -kl_coef * kl * mask.to(kl.dtype)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last_token_index(mask)] += scores.to(rewards.dtype)
    return rewards


# ---- advantages ----------------------------------------------------------------------------------


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response tokens; returns (advantages, returns).

    delta_t = r_t + gamma * V_{t+1} - V_t      (V after the last real token is 0: the episode ends there)
    A_t     = delta_t + gamma * lam * A_{t+1}
    R_t     = A_t + V_t                         (the value targets)
    """
    mask = mask.to(values.dtype)
    rewards, values = rewards * mask, values * mask  # padding: no reward, no value, so nothing flows back
    T = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    next_adv = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(values[:, 0])
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = delta + gamma * lam * next_adv
        advantages[:, t] = next_adv
    advantages = advantages * mask
    returns = (advantages + values) * mask
    return advantages, returns


# ---- losses --------------------------------------------------------------------------------------

Aggregation = Literal["token_mean", "sequence_mean"]


def aggregate(x: torch.Tensor, mask: torch.Tensor, how: Aggregation = "token_mean") -> torch.Tensor:
    """A per-token loss [B, T] as one number. token_mean: sum_i sum_t l_it / sum_i T_i, every token of the batch
    weighted alike (long answers weigh more). sequence_mean: (1 / B') sum_i (1 / T_i) sum_t l_it over the B' rows
    with a token, every answer weighted alike: a short answer's tokens weigh more, so with positive advantages
    it pushes toward short answers and with negative ones toward long ones (Liu et al. 2025, Dr. GRPO)."""
    if how == "token_mean":
        return masked_mean(x, mask)
    answered = mask.sum(1) > 0
    return masked_mean(x, mask, dim=1)[answered].mean() if answered.any() else (x * 0).sum()


def aggregation_units(mask: torch.Tensor, how: Aggregation = "token_mean") -> torch.Tensor:
    """What `aggregate` averages over: tokens, or answers with a token. A micro-batch's loss weighs its share."""
    return mask.sum() if how == "token_mean" else (mask.sum(1) > 0).sum().to(mask.dtype)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    aggregation: Aggregation = "token_mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clipped surrogate: L = agg_t -min(rho A, clip(rho, 1-eps, 1+eps) A), rho = pi / pi_old, agg a token or
    sequence mean (`aggregate`).

    Returns (loss, clipfrac = share of tokens where the clipped term is the active one,
    approxkl = 0.5 * agg (log pi - log pi_old)^2, a cheap estimate of KL(pi_old || pi)), aggregated alike."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = aggregate(torch.maximum(unclipped, clipped), mask, aggregation)  # max of negatives = -min of objectives
    with torch.no_grad():
        clipfrac = aggregate((clipped > unclipped).float(), mask, aggregation)
        approxkl = 0.5 * aggregate(log_ratio**2, mask, aggregation)
    return loss, clipfrac, approxkl


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float | None,
    aggregation: Aggregation = "token_mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: 0.5 * agg_t max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clip(V - V_old, +-eps_v).

    cliprange_value=None gives the plain 0.5 * (V - R)^2. Returns (loss, value clipfrac)."""
    unclipped = (values - returns) ** 2
    if cliprange_value is None:
        return 0.5 * aggregate(unclipped, mask, aggregation), torch.zeros((), device=values.device)
    v_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    clipped = (v_clipped - returns) ** 2
    loss = 0.5 * aggregate(torch.maximum(unclipped, clipped), mask, aggregation)
    with torch.no_grad():
        clipfrac = aggregate((clipped > unclipped).float(), mask, aggregation)
    return loss, clipfrac


# ---- learning-rate schedule ----------------------------------------------------------------------


def learning_rate(base_lr: float, update: int, total_updates: int, schedule: str) -> float:
    """The learning rate of update u (1-based) out of U.

    constant: lr
    linear:   lr * (1 - (u - 1) / U)    (annealed per update, as TRL does: 0 once the U updates are done)
    """
    if schedule == "constant":
        return base_lr
    if schedule == "linear":
        return base_lr * max(0.0, 1.0 - (update - 1) / total_updates)
    raise ValueError(f"unknown learning-rate schedule {schedule!r} (expected 'constant' or 'linear')")


# ---- KL coefficient controllers ------------------------------------------------------------------


class FixedKLController:
    """beta stays at its initial value."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al.: e = clip(KL / target - 1, -0.2, 0.2); beta <- beta * (1 + e * n_steps / horizon).

    KL above target makes beta grow, below makes it shrink; n_steps is the number of samples (responses)
    seen since the last update, so the adaptation speed does not depend on the batch size."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


# ---- running reward statistics -------------------------------------------------------------------


class RunningMoments:
    """Running mean and standard deviation of all scores seen so far (Chan et al.'s parallel update)."""

    def __init__(self) -> None:
        self.mean = 0.0
        self.var = 1.0  # population variance of the samples seen
        self.count = 0

    @property
    def std(self) -> float:
        return math.sqrt(self.var) if self.count > 1 and self.var > 0 else 1.0

    def update(self, xs: torch.Tensor) -> None:
        xs = xs.detach().double().flatten()
        n = xs.numel()
        if n == 0:
            return
        batch_mean = xs.mean().item()
        batch_var = xs.var(unbiased=False).item()
        if self.count == 0:
            self.mean, self.var, self.count = batch_mean, batch_var, n
            return
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.count = total

    def normalize(self, xs: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
        return (xs - self.mean) / (self.std + eps)

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), int(state["count"])


def trim_padding(qr: torch.Tensor, am: torch.Tensor, context_length: int):
    """Drop the columns that are padding in every row (left of the prompts, right of the responses); the
    result is unchanged (positions come from the mask) and the forward pass is cheaper."""
    real = am.bool()
    prompt_cols = real[:, :context_length].any(dim=0)
    left = min(int(prompt_cols.float().argmax()) if prompt_cols.any() else 0, context_length - 1)
    t_max = max(int(real[:, context_length:].sum(dim=1).max()), 1)
    return qr[:, left : context_length + t_max], am[:, left : context_length + t_max], context_length - left, t_max


def pad_to(x: torch.Tensor, T: int) -> torch.Tensor:
    """x [B, t] right-padded with zeros to T columns."""
    return torch.nn.functional.pad(x, (0, T - x.shape[1])) if x.shape[1] < T else x
