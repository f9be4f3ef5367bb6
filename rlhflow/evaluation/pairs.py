"""A reward model or judge measured on held-out preference pairs: accuracy with its standard error, the length rule
("the shorter answer is chosen") beside it with intervals, the score margins, and the pair scores a stage saves so
that evaluate measures the same model on the same pairs without scoring them again."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhflow.data.splits import conversation_key
from rlhflow.evaluation import stats
from rlhflow.fsutil import save_for_file, saved_for_file
from rlhflow.training.reward_model import RewardModel


def pair_correct(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Per pair: 1 where the chosen response scores higher, 0.5 on a tie, 0 else."""
    return (chosen > rejected).double() + 0.5 * (chosen == rejected).double()


def pairwise_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> float:
    """Fraction of pairs where the chosen response scores higher (ties count half)."""
    if len(chosen) == 0:
        return math.nan
    return float(pair_correct(chosen, rejected).mean())


def accuracy_standard_error(accuracy: float, pairs: int) -> float:
    """Binomial standard error of a pairwise accuracy over `pairs` independent pairs: sqrt(p (1 - p) / n)."""
    return math.sqrt(accuracy * (1 - accuracy) / pairs) if pairs else math.nan


@dataclass
class PairEvaluation:
    """A reward model on preference pairs, from one scoring pass. `chosen` and `rejected` are its raw scores
    (the Bradley-Terry logits), one per pair. `metrics`: `accuracy` (of the raw scores, ties half), its
    `accuracy_se` and 95% Wilson interval; the length rule on the same pairs (`length_baseline_accuracy`, "the
    shorter answer is chosen") with its Wilson interval, and the paired difference `accuracy_minus_length_baseline`
    with a paired-bootstrap interval; `pairs`; and `margin_mean`, `chosen_mean`, `rejected_mean` of the normalised
    scores (the rewards PPO gets)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    metrics: dict[str, float]

    @property
    def correct(self) -> torch.Tensor:
        return pair_correct(self.chosen, self.rejected)


# what `length_aware_pair_metrics` adds to a pair evaluation's metrics
LENGTH_AWARE_METRICS = (
    "accuracy_ci_low",
    "accuracy_ci_high",
    "length_baseline_accuracy",
    "length_baseline_accuracy_ci_low",
    "length_baseline_accuracy_ci_high",
    "accuracy_minus_length_baseline",
    "accuracy_minus_length_baseline_ci_low",
    "accuracy_minus_length_baseline_ci_high",
    "accuracy_chosen_shorter",
    "accuracy_chosen_shorter_ci_low",
    "accuracy_chosen_shorter_ci_high",
    "pairs_chosen_shorter",
    "accuracy_chosen_longer",
    "accuracy_chosen_longer_ci_low",
    "accuracy_chosen_longer_ci_high",
    "pairs_chosen_longer",
    "accuracy_lc",
    "accuracy_lc_ci_low",
    "accuracy_lc_ci_high",
    "accuracy_lc_supported",
)
# what it adds where the model grades its preference (a reward model's Bradley-Terry probability for the chosen
# answer): the soft scale, named apart from the accuracies
SOFT_PAIR_METRICS = (
    "soft_accuracy",
    "soft_accuracy_ci_low",
    "soft_accuracy_ci_high",
    "soft_accuracy_lc",
    "soft_accuracy_lc_ci_low",
    "soft_accuracy_lc_ci_high",
)


def pair_figures(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    """The length-aware figures of a pair evaluation (and the soft ones where it has them) as `<prefix>/<name>`."""
    return {f"{prefix}/{key}": metrics[key] for key in LENGTH_AWARE_METRICS + SOFT_PAIR_METRICS if key in metrics}


def length_aware_pair_metrics(correct, rows: list[dict], seed: int = 0, preference=None) -> dict[str, float]:
    """A model's per-pair correctness next to the length rule's on the same pairs (rlhflow.evaluation.stats), and
    under length control: its accuracy on the pairs whose chosen answer is the shorter (in words, as the rule counts)
    and on those whose chosen answer is the longer, each with its Wilson interval, and its length-controlled
    accuracy, the correctness (1, 0.5, 0) predicted at a length difference of 0 (AlpacaEval's GLM on the difference
    in characters, `stats.length_controlled_win_rate`; the length rule's is 0.5 by construction). Where `preference`
    is given per pair (a reward model's Bradley-Terry probability sigmoid(r_c - r_r)), its mean and its
    length-controlled value too, as `soft_accuracy` and `soft_accuracy_lc` (SOFT_PAIR_METRICS)."""
    correct = [float(c) for c in correct]
    chosen, rejected = [r["chosen"] for r in rows], [r["rejected"] for r in rows]
    rule = stats.shorter_answer_correct(chosen, rejected)
    n = len(rows)
    low, high = stats.wilson_interval(sum(correct), n)  # proportions: Wilson intervals
    rule_low, rule_high = stats.wilson_interval(float(rule.sum()), n)
    # pairs of one conversation (several depths, several rejected answers) are resampled together
    keyed = all("prompt_messages" in r for r in rows)
    conversations = [conversation_key(r["prompt_messages"]) for r in rows] if keyed else None
    weights = stats.resample_weights(n, conversations, seed=seed)
    difference, diff_low, diff_high = stats.difference_interval(correct, rule, weights)
    shorter, longer = accuracy_where(correct, rule == 1), accuracy_where(correct, rule == 0)  # ties: neither
    char_difference = [len(c) - len(r) for c, r in zip(chosen, rejected)]
    lc = stats.length_controlled_win_rate(correct, char_difference, weights)
    metrics = {
        "accuracy_ci_low": low,
        "accuracy_ci_high": high,
        "length_baseline_accuracy": float(rule.mean()) if n else math.nan,
        "length_baseline_accuracy_ci_low": rule_low,
        "length_baseline_accuracy_ci_high": rule_high,
        "accuracy_minus_length_baseline": difference,
        "accuracy_minus_length_baseline_ci_low": diff_low,
        "accuracy_minus_length_baseline_ci_high": diff_high,
        "accuracy_chosen_shorter": shorter[0],
        "accuracy_chosen_shorter_ci_low": shorter[1],
        "accuracy_chosen_shorter_ci_high": shorter[2],
        "pairs_chosen_shorter": shorter[3],
        "accuracy_chosen_longer": longer[0],
        "accuracy_chosen_longer_ci_low": longer[1],
        "accuracy_chosen_longer_ci_high": longer[2],
        "pairs_chosen_longer": longer[3],
        "accuracy_lc": lc.value,
        "accuracy_lc_ci_low": lc.low,
        "accuracy_lc_ci_high": lc.high,
        "accuracy_lc_supported": float(lc.supported),
    }
    if preference is not None:
        preference = [float(p) for p in preference]
        soft, soft_low, soft_high = stats.mean_interval(preference, weights)
        soft_lc = stats.length_controlled_win_rate(preference, char_difference, weights)
        metrics.update(
            {
                "soft_accuracy": soft,
                "soft_accuracy_ci_low": soft_low,
                "soft_accuracy_ci_high": soft_high,
                "soft_accuracy_lc": soft_lc.value,
                "soft_accuracy_lc_ci_low": soft_lc.low,
                "soft_accuracy_lc_ci_high": soft_lc.high,
            }
        )
    return metrics


def accuracy_where(correct: list[float], subset) -> tuple[float, float, float, float]:
    """Accuracy on the pairs of `subset` (a boolean mask), its Wilson interval and the number of pairs."""
    picked = [c for c, keep in zip(correct, subset) if keep]
    low, high = stats.wilson_interval(sum(picked), len(picked))
    return (sum(picked) / len(picked) if picked else math.nan), low, high, float(len(picked))


def evaluate_pairs(
    rm: RewardModel, rows: list[dict], *, scores: tuple[torch.Tensor, torch.Tensor] | None = None
) -> PairEvaluation:
    """Score each row's chosen and rejected response to its `prompt_messages` and measure the pairs. `scores`: the
    raw (chosen, rejected) scores of these rows by this model, when they were saved already (`saved_pair_scores`)."""
    if scores is None:
        prompts = [r["prompt_messages"] for r in rows]
        chosen = rm.raw_scores(prompts, [r["chosen"] for r in rows])
        scores = chosen, rm.raw_scores(prompts, [r["rejected"] for r in rows])
    chosen, rejected = scores
    chosen_rewards, rejected_rewards = rm.normalise(chosen), rm.normalise(rejected)
    accuracy = pairwise_accuracy(chosen, rejected)
    metrics = {
        "accuracy": accuracy,
        "accuracy_se": accuracy_standard_error(accuracy, len(rows)),
        **length_aware_pair_metrics(
            pair_correct(chosen, rejected).tolist(), rows, preference=(chosen - rejected).sigmoid()
        ),
        "margin_mean": float((chosen_rewards - rejected_rewards).mean()),
        "chosen_mean": float(chosen_rewards.mean()),
        "rejected_mean": float(rejected_rewards.mean()),
        "pairs": float(len(rows)),
    }
    return PairEvaluation(chosen, rejected, metrics)


# The raw scores of the test split's pairs, saved beside the model by the stage that trained it: evaluate measures
# the same model on the same pairs from them rather than score them again. They name the split file by its md5, so
# scores of another split are never taken for this one.
HELD_OUT_SCORES_FILE = "held_out_scores.json"


def save_pair_scores(model_dir: str | os.PathLike, pairs: PairEvaluation, *, data_file: str | os.PathLike) -> None:
    scores = {"chosen": pairs.chosen.tolist(), "rejected": pairs.rejected.tolist()}
    save_for_file(Path(model_dir) / HELD_OUT_SCORES_FILE, scores, data_file=data_file)


def saved_pair_scores(
    model_dir: str | os.PathLike, *, data_file: str | os.PathLike
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The raw (chosen, rejected) scores saved in `model_dir` for `data_file` as it is now; None when there are
    none for it."""
    record = saved_for_file(Path(model_dir) / HELD_OUT_SCORES_FILE, data_file=data_file)
    if record is None:
        return None
    return torch.tensor(record["chosen"], dtype=torch.float32), torch.tensor(record["rejected"], dtype=torch.float32)
