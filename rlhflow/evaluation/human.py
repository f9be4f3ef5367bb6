"""People as the judge: the policy's win rate over the SFT model by human labels, and how often the judge and the
length rule agree with the people (docs/feedback.md#people-as-the-judge)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rlhflow.data.feedback import settled
from rlhflow.data.splits import conversation_key
from rlhflow.evaluation import stats
from rlhflow.evaluation.compare import BOOTSTRAP_SEED, WinKeys, win_metrics
from rlhflow.evaluation.judges import Verdicts

HUMAN_WIN_KEYS = WinKeys(
    "feedback/human_win_rate_vs_sft",
    "feedback/human_win_rate",
    "feedback/human_win_rate_both_ended",
    "feedback/human_win_rate_lc",
    "feedback/human_win_rate_lc_supported",
)


def judged_pairs(pairs: Sequence[dict], labels: Sequence[dict]) -> list[tuple[dict, str]]:
    """The pairs people settled as a side or a tie (skips and conflicts left out), with what they settled. Only
    people's labels count here: an AI label (source `ai`) is the judge's, which this measures against them."""
    outcome = settled([x for x in labels if x["source"] == "human"])
    return [(p, outcome[p["pair_id"]]) for p in pairs if outcome.get(p["pair_id"]) in ("a", "b", "tie")]


def policy_preference(pair: dict, verdict: str) -> float:
    """1 when people preferred the policy's answer, 0 the SFT model's, 0.5 a tie."""
    return 0.5 if verdict == "tie" else float(verdict == pair["policy_side"])


def human_win_metrics(judged: list[tuple[dict, str]]) -> dict[str, float]:
    """The policy's win rate over the SFT model by people: overall, where both answers ended, length-controlled,
    each with its 95% interval from resampling conversations (the evaluation's estimators)."""
    if not judged:
        return {"feedback/human_judged_pairs": 0.0}
    preference = np.array([policy_preference(p, v) for p, v in judged])
    policy_text = [p[f"answer_{p['policy_side']}"] for p, _ in judged]
    sft_text = [p["answer_b" if p["policy_side"] == "a" else "answer_a"] for p, _ in judged]
    conversations = [conversation_key(p["prompt_messages"]) for p, _ in judged]
    weights = stats.resample_weights(len(judged), clusters=conversations, seed=BOOTSTRAP_SEED)
    both_ended = np.array([bool(p.get("both_ended", False)) for p, _ in judged])
    char_difference = np.array([len(a) - len(b) for a, b in zip(policy_text, sft_text)], dtype=float)
    verdicts = Verdicts(wins=preference, preference=preference)
    metrics = win_metrics(HUMAN_WIN_KEYS, verdicts, both_ended, char_difference, weights, conversations)
    metrics["feedback/human_judged_pairs"] = float(len(judged))
    metrics["feedback/human_ties"] = float(sum(v == "tie" for _, v in judged))
    return metrics


def agreement_metrics(judged: list[tuple[dict, str]], judge_prefers_a: np.ndarray | None) -> dict[str, float]:
    """On the pairs people decided (ties left out): how often the length rule ("the shorter answer wins") and the
    judge (`judge_prefers_a`: per judged pair, 1 when it prefers answer a, 0.5 a tie) pick the people's answer, and
    the judge's lead over the rule, each with its interval. Which instrument to believe: the one that agrees more."""
    decided = [i for i, (_, v) in enumerate(judged) if v != "tie"]
    if not decided:
        return {}
    chosen = [judged[i][0][f"answer_{judged[i][1]}"] for i in decided]
    rejected = [judged[i][0]["answer_b" if judged[i][1] == "a" else "answer_a"] for i in decided]
    conversations = [conversation_key(judged[i][0]["prompt_messages"]) for i in decided]
    weights = stats.resample_weights(len(decided), clusters=conversations, seed=BOOTSTRAP_SEED)
    length_rule = stats.shorter_answer_correct(chosen, rejected)
    low_high = stats.mean_interval(length_rule, weights)
    metrics = {
        "feedback/decided_pairs": float(len(decided)),
        "feedback/length_rule_agreement": low_high[0],
        "feedback/length_rule_agreement_ci_low": low_high[1],
        "feedback/length_rule_agreement_ci_high": low_high[2],
    }
    if judge_prefers_a is not None:
        prefers_a = np.asarray(judge_prefers_a, dtype=float)[decided]
        judge = np.where([judged[i][1] == "a" for i in decided], prefers_a, 1 - prefers_a)
        value, low, high = stats.mean_interval(judge, weights)
        lead, lead_low, lead_high = stats.difference_interval(judge, length_rule, weights)
        metrics |= {
            "feedback/judge_agreement": value,
            "feedback/judge_agreement_ci_low": low,
            "feedback/judge_agreement_ci_high": high,
            "feedback/judge_minus_length_rule": lead,
            "feedback/judge_minus_length_rule_ci_low": lead_low,
            "feedback/judge_minus_length_rule_ci_high": lead_high,
        }
    return metrics
