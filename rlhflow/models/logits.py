"""Per-token quantities from a language model's logits, as pure tensor functions: the log-probability of the
chosen token, the entropy of the distribution, and the per-token KL estimate between two models' log-probabilities.
rlhflow/models/policy.py computes them for the policy and the reference; they import nothing of the project, so policy,
PPO and evaluation code can all use them without a cycle (and without loading one another)."""

from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(l) - sum_v softmax(l)_v * l_v, per position."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] without materialising the full log-softmax."""
    picked = torch.gather(logits, -1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled token's log-probabilities.

    k1 = log p - log p_ref                 (unbiased, can be negative)
    k3 = (r - 1) - log r, r = p_ref / p    (unbiased, always >= 0, lower variance)
    """
    log_ratio = logprobs - ref_logprobs  # log p - log p_ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        log_r = -log_ratio  # log(p_ref / p)
        return torch.expm1(log_r) - log_r  # (r - 1) - log r, expm1 for precision near r = 1
    raise ValueError(f"unknown KL estimator {estimator!r} (expected 'k1' or 'k3')")
