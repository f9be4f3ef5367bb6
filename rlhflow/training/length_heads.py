"""A reward model that tells length from quality (ODIN: Chen et al. 2024, "Disentangled Reward Mitigates Hacking in
RLHF", arXiv 2402.07319): two linear heads on the backbone's pooled features, trained jointly on the pairs.

For a response y of length |y| (in the reward tokenizer's tokens) the heads give a quality score q(y) and a length
score l(y); the Bradley-Terry preference is their sum, r = q + l. Over a batch of pairs (2B responses):

    L = -mean log sigmoid(r_c - r_r)                              the pairs, as a one-head reward model learns them
        + lambda_len * [(1 - rho(l, |y|)) + |rho(q, |y|)|]        l tracks length, q is uncorrelated with it
        + lambda_orth * |cos(w_q - mean w_q, w_l - mean w_l)|     the heads read different directions of the features

with rho the Pearson correlation over the batch's responses and w_q, w_l the heads' weight vectors, centred and
compared by their cosine, so the term does not depend on the weights' scale. PPO, GRPO and RLOO optimise q alone:
the length a response gains or loses no longer pays, while the preference as a whole is still fitted (l takes the
part of it length explains). Column 0 of the score head is q, so a reader of the first column, as every reader of
a one-head model does, reads the quality head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QUALITY, LENGTH = 0, 1  # the score head's output columns
HEAD_NAMES = {QUALITY: "quality", LENGTH: "length"}


def pearson(x: torch.Tensor, y: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """The Pearson correlation of two vectors, differentiable; 0 where either has no spread (a batch of one length)."""
    x, y = x.float() - x.float().mean(), y.float() - y.float().mean()
    spread = x.norm() * y.norm()
    return (x * y).sum() / spread if spread > eps else x.sum() * 0.0


def centred_cosine(a: torch.Tensor, b: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    a, b = a.float() - a.float().mean(), b.float() - b.float().mean()
    return (a * b).sum() / (a.norm() * b.norm()).clamp_min(eps)


def score_head(model) -> torch.nn.Linear:
    """The linear layer that gives a sequence classifier's scores: `score` (decoders), `classifier` (BERT-like)."""
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Linear):
            return head
    raise ValueError(f"{type(model).__name__} has no linear score head (`score` or `classifier`) to split in two")


def length_disentangled_loss(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    head_weight: torch.Tensor,
    *,
    length_weight: float,
    orthogonality_weight: float,
    center_coefficient: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of the module docstring. `scores` [2B, 2]: the chosen responses' rows, then the rejected ones' (as
    trl's collator stacks them); `lengths` [2B] in the same order; `head_weight` [2, H]. `center_coefficient`: trl's
    term c * mean(r^2) on the preference scores (None: off). Returns (loss, its parts and the batch's figures)."""
    preference = scores[:, QUALITY] + scores[:, LENGTH]
    chosen, rejected = preference.chunk(2)
    pairs = -F.logsigmoid(chosen - rejected).mean()
    rho_length = pearson(scores[:, LENGTH], lengths)
    rho_quality = pearson(scores[:, QUALITY], lengths)
    correlation = (1 - rho_length) + rho_quality.abs()
    overlap = centred_cosine(head_weight[QUALITY], head_weight[LENGTH]).abs()
    loss = pairs + length_weight * correlation + orthogonality_weight * overlap
    if center_coefficient is not None:
        loss = loss + center_coefficient * (preference**2).mean()
    quality_chosen, quality_rejected = scores[:, QUALITY].chunk(2)
    parts = {
        "pair_loss": pairs.item(),
        "length_head_correlation": rho_length.item(),
        "quality_head_correlation": rho_quality.item(),
        "head_overlap": overlap.item(),
        "quality_accuracy": (quality_chosen > quality_rejected).float().mean().item(),
    }
    return loss, parts
