"""Per-token quantities from a language model's logits, as pure tensor functions: the log-probability of the
chosen token and the entropy of the distribution. rlhflow/policy.py computes them for the policy and the
reference; they import nothing of the project, so policy and PPO code can both use them without a cycle."""

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
