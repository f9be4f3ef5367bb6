"""What the evaluate stage measures (`PolicyEvaluator`): the policy against the SFT model's answers on one prompt per
held-out conversation (rlhflow.evaluation.held_out), by the proxy and the judge (rlhflow.evaluation.judges): win
rates overall, where both answers ended and length-controlled, with intervals over conversations
(rlhflow.evaluation.stats); the answers' classes and drift, KL and perplexity (rlhflow.evaluation.metrics); the proxy
on held-out pairs (rlhflow.evaluation.pairs). Every figure on the test split (eval/...), the choosing ones on the dev
split (dev/...); and the head-to-head comparisons the champion rule reads. What each figure is: docs/evaluation.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from rlhflow.config.evaluate import ChampionConfig
from rlhflow.data.splits import conversation_keys
from rlhflow.evaluation import stats
from rlhflow.evaluation.answers import Answers
from rlhflow.evaluation.champion import HeadToHead, alpha_spent, guard_failures, sign_test
from rlhflow.evaluation.frontier import objective_scores
from rlhflow.evaluation.held_out import HeldOutData, as_precision, sample_answers, score_answers
from rlhflow.evaluation.judges import verdicts_from_scores
from rlhflow.evaluation.metrics import (
    confidence_buckets,
    distinct_n,
    expected_calibration_error,
    mean_length,
    perplexity,
    ranking_agreement,
    repetition_rate,
    sampled_kl,
)
from rlhflow.evaluation.pairs import evaluate_pairs, pair_figures
from rlhflow.evaluation.settings import EvaluationSettings

# the bootstrap's seed: fixed, so every run's intervals are drawn the same way whatever its training seed
BOOTSTRAP_SEED = 0


# ---- figures ------------------------------------------------------------------------------------------------------


def text_metrics(answers: Answers) -> dict[str, float]:
    """Drift and reward-hacking signals of one model's answers: the share of each answer class (answers.CLASSES),
    length, EOS share, distinct-n, repetition."""
    texts, shares = answers.texts, answers.shares()
    return {
        "eval/answers_ended": shares["ended"],
        "eval/answers_cut": shares["cut"],
        "eval/answers_degenerate": shares["degenerate"],
        "eval/eos_fraction": float(np.mean(answers.ended)) if len(answers) else math.nan,
        "eval/answer_tokens": float(np.mean(answers.tokens)) if len(answers) else math.nan,
        "eval/response_length": mean_length(texts),
        "eval/distinct_1": distinct_n(texts, 1),
        "eval/distinct_2": distinct_n(texts, 2),
        "eval/repetition_rate": repetition_rate(texts),
    }


def sft_side(metrics: dict[str, float]) -> dict[str, float]:
    """The SFT model's figures beside the policy's: the same names with `_sft` appended."""
    return {f"{key}_sft": value for key, value in metrics.items()}


def _with_interval(name: str, value_low_high: tuple[float, float, float], interval: str = "") -> dict[str, float]:
    """`name` and its interval as `<interval or name>_ci_low` / `_ci_high`."""
    value, low, high = value_low_high
    return {name: value, f"{interval or name}_ci_low": low, f"{interval or name}_ci_high": high}


class WinKeys(NamedTuple):
    """The names of one verdict source's win-rate figures (`win_metrics`). The win rates are on hard verdicts (1, 0.5,
    0); a judge that grades its preference (a reward model: sigmoid of the score difference) adds the soft scale's
    mean and length-controlled value under names of their own, never beside a hard figure unnamed."""

    vs_sft: str  # the win rate over the SFT model's answer to the same prompt
    interval: str  # its interval, as <interval>_ci_low / _ci_high
    both_ended: str  # the same on the prompts where both answers ended
    lc: str  # length-controlled, fitted on the same hard verdicts
    lc_supported: str  # 1 when the length differences support reading either length-controlled figure at zero
    soft: str | None = None  # the mean soft preference, where the judge grades it
    soft_lc: str | None = None  # its length-controlled value


PROXY_WIN_KEYS = WinKeys(
    "eval/win_rate_vs_sft",
    "eval/win_rate",
    "eval/win_rate_both_ended",
    "eval/win_rate_lc",
    "eval/win_rate_lc_supported",
    "eval/soft_preference",
    "eval/soft_preference_lc",
)
JUDGE_WIN_KEYS = WinKeys(
    "eval/judge_win_rate_vs_sft",
    "eval/judge_win_rate",
    "eval/judge_win_rate_both_ended",
    "eval/judge_win_rate_lc",
    "eval/judge_win_rate_lc_supported",
    "eval/judge_soft_preference",
    "eval/judge_soft_preference_lc",
)


def win_metrics(keys: WinKeys, verdicts, both_ended: np.ndarray, char_difference, weights, conversations):
    """The win rate over the SFT model and its interval, the same on prompts where both answers ended, and the
    length-controlled win rate with its support flag, all on the hard verdicts; where the verdicts are soft, the mean
    soft preference and its length-controlled value beside them, named apart (`keys`: PROXY_WIN_KEYS,
    JUDGE_WIN_KEYS)."""
    win = np.asarray(verdicts.wins, dtype=float)
    metrics = _with_interval(keys.vs_sft, stats.mean_interval(win, weights), keys.interval)
    if both_ended.any():
        idx = np.flatnonzero(both_ended)
        sub_weights = stats.resample_weights(len(idx), clusters=[conversations[i] for i in idx], seed=BOOTSTRAP_SEED)
        metrics.update(_with_interval(keys.both_ended, stats.mean_interval(win[idx], sub_weights)))
    lc = stats.length_controlled_win_rate(win, char_difference, weights, prompt_ids=conversations)
    metrics.update(_with_interval(keys.lc, lc.interval))
    metrics[keys.lc_supported] = float(lc.supported)
    if verdicts.soft and keys.soft:
        preference = np.asarray(verdicts.preference, dtype=float)
        metrics.update(_with_interval(keys.soft, stats.mean_interval(preference, weights)))
        soft_lc = stats.length_controlled_win_rate(preference, char_difference, weights, prompt_ids=conversations)
        metrics.update(_with_interval(keys.soft_lc, soft_lc.interval))
    return metrics


HEAD_TO_HEAD_KEYS = WinKeys(
    "compare/judge_win_rate_a_over_b",
    "compare/judge_win_rate",
    "compare/judge_win_rate_both_ended",
    "compare/judge_win_rate_lc",
    "compare/judge_win_rate_lc_supported",
    "compare/judge_soft_preference",
    "compare/judge_soft_preference_lc",
)


def head_to_head_metrics(a: Answers, b: Answers, judged, conversations: list[str]) -> dict[str, float]:
    """Policy A against policy B on the same prompts (row i of each: the same prompt and random stream), by the
    judge: A's win rate overall, where both answers ended and length-controlled, each with its 95% interval from
    resamples of the conversations (the figures the evaluation gives a policy against the SFT model), and each
    side's answer classes and lengths."""
    weights = stats.resample_weights(len(a), clusters=conversations, seed=BOOTSTRAP_SEED)
    both_ended = a.is_class("ended") & b.is_class("ended")
    char_difference = np.array([len(x) - len(y) for x, y in zip(a.texts, b.texts)], dtype=float)
    sides = {
        f"compare/{side}_{key.removeprefix('eval/')}": value
        for side, answers in (("a", a), ("b", b))
        for key, value in text_metrics(answers).items()
    }
    return {
        "compare/prompts": float(len(set(conversations))),
        "compare/answers": float(len(a)),
        "compare/both_ended_prompts": float(both_ended.sum()),
        **win_metrics(HEAD_TO_HEAD_KEYS, judged, both_ended, char_difference, weights, conversations),
        **sides,
    }


def judge_verdicts(judge, prompts, texts: list[str], other_texts: list[str]):
    """The judge's verdicts of `texts` against `other_texts`, row by row (a pointwise judge scores each side)."""
    if judge.pointwise:
        return verdicts_from_scores(judge.score(prompts, texts), judge.score(prompts, other_texts))
    return judge.compare(prompts, texts, other_texts)


def comparison_metrics(
    policy: Answers,
    sft: Answers,
    proxy,
    judge,
    conversations: list[str],
    judge_scores=None,
    missing_eos_penalty: float | None = None,
) -> dict[str, float]:
    """The policy against the SFT model on the same prompts (row i of each: the same prompt and sample), by the proxy
    and the judge (`Verdicts`): mean rewards, win rates overall and where both answers ended, their
    length-controlled versions and the proxy-judge gap, each with a 95% interval from one set of resamples of the
    conversations. `judge_scores`: (policy, sft) scores of a pointwise judge, for its mean rewards.
    `eval/objective_mean` is the score PPO optimised: the proxy minus `missing_eos_penalty` for an answer that did
    not end (the frontier compares best-of-n with the policies on it)."""
    weights = stats.resample_weights(len(policy), clusters=conversations, seed=BOOTSTRAP_SEED)
    both_ended = policy.is_class("ended") & sft.is_class("ended")
    char_difference = np.array([len(p) - len(s) for p, s in zip(policy.texts, sft.texts)], dtype=float)
    policy_proxy, sft_proxy = (np.asarray(x.extra["proxy"], dtype=float) for x in (policy, sft))
    metrics = {
        "eval/prompts": float(len(set(conversations))),
        "eval/answers": float(len(policy)),
        "eval/expected_half_width": stats.expected_half_width(len(set(conversations))),
        "eval/both_ended_prompts": float(both_ended.sum()),
        **_with_interval("eval/reward_mean", stats.mean_with_interval(policy_proxy, weights)),
        "eval/reward_mean_sft": float(sft_proxy.mean()),
        **win_metrics(PROXY_WIN_KEYS, proxy, both_ended, char_difference, weights, conversations),
        **win_metrics(JUDGE_WIN_KEYS, judge, both_ended, char_difference, weights, conversations),
        # reward hacking shows as a proxy win rate above the judge's
        **_with_interval("eval/proxy_judge_gap", stats.difference_interval(proxy.wins, judge.wins, weights)),
    }
    if missing_eos_penalty is not None:
        objective = objective_scores(policy_proxy, np.asarray(policy.ended), missing_eos_penalty)
        metrics.update(_with_interval("eval/objective_mean", stats.mean_with_interval(objective, weights)))
        sft_objective = objective_scores(sft_proxy, np.asarray(sft.ended), missing_eos_penalty)
        metrics["eval/objective_mean_sft"] = float(sft_objective.mean())
    if judge_scores is not None:
        policy_judged, sft_judged = (np.asarray(x, dtype=float) for x in judge_scores)
        metrics.update(_with_interval("eval/judge_reward_mean", stats.mean_with_interval(policy_judged, weights)))
        metrics["eval/judge_reward_mean_sft"] = float(sft_judged.mean())
    if judge.malformed:
        metrics["eval/judge_malformed"] = float(judge.malformed)
    return metrics


def reward_model_metrics(pairs, rows: list[dict]) -> tuple[dict[str, float], list]:
    """The proxy on the held-out pairs (`rlhflow.evaluation.pairs.evaluate_pairs` of `rows`) as `rm/` metrics:
    accuracy and the length rule beside it, calibration, and agreement of its scores with the human ranking of
    each prompt's responses; and the confidence buckets (rlhflow.evaluation.metrics.ConfidenceBucket) behind the
    calibration."""
    buckets = confidence_buckets(pairs.chosen - pairs.rejected)  # raw scores: the Bradley-Terry probability
    scores = {}
    for row, c, r in zip(rows, pairs.chosen.tolist(), pairs.rejected.tolist()):
        scores.setdefault((row["prompt"], row["chosen"]), c)
        scores.setdefault((row["prompt"], row["rejected"]), r)
    tau, ranked_prompts = ranking_agreement(rows, scores)
    metrics = {
        "rm/accuracy": pairs.metrics["accuracy"],
        **pair_figures(pairs.metrics, "rm"),
        "rm/ece": expected_calibration_error(buckets),
        "rm/kendall_tau": tau,
        "rm/ranked_prompts": float(ranked_prompts),
    }
    metrics.update({f"rm/accuracy_conf_{b.label}": b.accuracy for b in buckets})
    return metrics, buckets


# ---- the dev split's figures, for choosing ------------------------------------------------------------------------

# what the dev split reports: what a choice reads, not the whole evaluation. dev/<name> is eval/<name> measured on the
# dev split, with its interval where it has one (<name>_ci_low, <name>_ci_high).
DEV_FIGURES = {
    "dev/prompts": "eval/prompts",
    "dev/expected_half_width": "eval/expected_half_width",
    "dev/both_ended_prompts": "eval/both_ended_prompts",
    "dev/win_rate_vs_sft": "eval/win_rate_vs_sft",
    "dev/win_rate": "eval/win_rate",  # the interval of win_rate_vs_sft
    "dev/win_rate_both_ended": "eval/win_rate_both_ended",
    "dev/win_rate_lc": "eval/win_rate_lc",
    "dev/win_rate_lc_supported": "eval/win_rate_lc_supported",
    "dev/judge_win_rate_vs_sft": "eval/judge_win_rate_vs_sft",
    "dev/judge_win_rate": "eval/judge_win_rate",  # the interval of judge_win_rate_vs_sft
    "dev/judge_win_rate_both_ended": "eval/judge_win_rate_both_ended",
    "dev/judge_win_rate_lc": "eval/judge_win_rate_lc",
    "dev/judge_win_rate_lc_supported": "eval/judge_win_rate_lc_supported",
    "dev/objective_mean": "eval/objective_mean",
    "dev/answers_ended": "eval/answers_ended",
    "dev/answers_cut": "eval/answers_cut",
    "dev/answers_degenerate": "eval/answers_degenerate",
    "dev/answer_tokens": "eval/answer_tokens",
    "dev/eos_fraction": "eval/eos_fraction",
}


def dev_metrics(metrics: dict[str, float], kl: float) -> dict[str, float]:
    """The choosing figures (DEV_FIGURES) of a comparison on the dev split (`comparison_metrics` and `text_metrics`
    of its answers); NaN ones left out."""
    chosen = {
        dev + part: metrics[name + part]
        for dev, name in DEV_FIGURES.items()
        for part in ("", "_ci_low", "_ci_high")
        if name + part in metrics and not math.isnan(metrics[name + part])
    }
    return chosen | ({"dev/kl": kl} if not math.isnan(kl) else {})


@dataclass
class DevAnswers:
    """The evaluated policy on the dev split: what the champion rule compares and guards."""

    prompts: list
    conversations: list[str]
    answers: Answers
    kl: float  # mean KL to the SFT model on these answers (NaN: not measured, no guard reads it)


# ---- head to head, for the champion rule ------------------------------------------------------------------------


def policy_head_to_head(
    verdicts, conversations: list[str], rule: ChampionConfig, challenge: int, guards_failed: tuple[str, ...] = ()
) -> HeadToHead:
    """The challenger's win rate over the champion by the judge on the pairs given (both answers ended), with the
    sign test over their conversations at the level of this challenge."""
    weights = stats.resample_weights(len(verdicts.wins), clusters=conversations, seed=BOOTSTRAP_SEED)
    return HeadToHead(
        "judge win rate over the champion, both ended",
        *stats.mean_interval(verdicts.wins, weights),
        test=sign_test(verdicts.wins, conversations, tie=0.5),
        level=alpha_spent(rule.alpha, challenge),
        challenge=challenge,
        guards_failed=guards_failed,
    )


def reward_model_head_to_head(
    challenger_correct, champion_correct, conversations: list[str], rule: ChampionConfig, challenge: int
) -> HeadToHead:
    """The challenger's accuracy minus the champion's on the same pairs, with the sign test over their
    conversations (pairs both rank alike are ties) at the level of this challenge."""
    weights = stats.resample_weights(len(challenger_correct), clusters=conversations, seed=BOOTSTRAP_SEED)
    value = stats.difference_interval(challenger_correct, champion_correct, weights)
    difference = np.asarray(challenger_correct, dtype=float) - np.asarray(champion_correct, dtype=float)
    return HeadToHead(
        "accuracy minus the champion's",
        *value,
        test=sign_test(difference, conversations, tie=0.0),
        level=alpha_spent(rule.alpha, challenge),
        challenge=challenge,
    )


# ---- the evaluate stage's measurements ---------------------------------------------------------------------------


@dataclass
class PolicyEvaluation:
    """What `PolicyEvaluator.evaluate` measured, with what the champion comparisons need to measure more on the same
    items."""

    metrics: dict[str, float]
    samples: dict[str, list]  # per answer: the prompt, both answers, their classes, proxy and judge figures, the KL
    buckets: list  # the reward model's confidence buckets (calibration)
    pairs: Any  # the proxy's verdict on each test pair (rlhflow.evaluation.pairs.evaluate_pairs)
    dev: DevAnswers | None  # the policy on the dev split (None: not answered yet, or no dev split)


def _verdicts(judge, prompts, policy: Answers, sft: Answers):
    """The judge's verdicts of policy against SFT (row by row) and, for a pointwise judge, both sides' scores."""
    if judge.pointwise:
        scores = (policy.extra["judge"], sft.extra["judge"])
        return verdicts_from_scores(*scores), scores
    return judge.compare(prompts, policy.texts, sft.texts), None


@dataclass
class EvaluatedModels:
    """The models an evaluation compares and scores with, loaded once by its stage."""

    device: Any
    dtype: Any  # the sampling and KL precision (evaluate.precision)
    tokenizer: Any
    sft: Any
    policy: Any
    rm: Any  # the proxy (rlhflow.training.reward_model.RewardModel)
    judge: Any  # rlhflow.evaluation.judges.Judge


class PolicyEvaluator:
    """The policy against the SFT model's answers (the sft_answers stage) on one prompt per held-out conversation,
    scored by the proxy and the judge; then, for the champion rule, against another policy or reward model on the
    dev split. It gets the settings, the loaded models and the held-out data (`HeldOutData`) from its stage."""

    def __init__(self, settings: EvaluationSettings, models: EvaluatedModels, data: HeldOutData, lines=None):
        self.settings = settings
        self.models = models
        self.data = data
        self.lines = lines  # progress lines while it samples and scores (rlhflow.progress.ProgressLines)

    def evaluate(self) -> PolicyEvaluation:
        """Every figure on the test split (eval/...), and with `evaluate.dev_figures` the choosing figures on the dev
        split (dev/...); the proxy's accuracy on every test pair; perplexities on the chosen responses of the first
        `perplexity_rows` test prompts. Figures that are NaN (no value) are left out."""
        held_out, reference = self.data.prompts, self.data.reference
        parts, kl = self.answer_held_out()
        figures = {split: self.split_figures(split, answers, reference[split]) for split, answers in parts.items()}
        test_figures, judged, judge_scores = figures["test"]
        metrics, pairs, buckets = self.test_metrics(kl["test"])
        metrics = {**test_figures, **metrics}
        dev = None
        if "dev" in parts:
            dev_kl = float(kl["dev"].mean())
            metrics.update(dev_metrics(figures["dev"][0], dev_kl))
            dev = DevAnswers(held_out.prompts["dev"], held_out.conversations["dev"], parts["dev"], dev_kl)
        samples = answer_samples(held_out, parts["test"], reference["test"], judged, judge_scores, kl["test"])
        return PolicyEvaluation(
            metrics={k: v for k, v in metrics.items() if not math.isnan(v)},  # NaN: "no value" (tracking.valued)
            samples=samples,
            buckets=buckets,
            pairs=pairs,
            dev=dev,
        )

    def answer_held_out(self):
        """The policy's answers to the splits answered up front (the test split; the dev split too with
        `evaluate.dev_figures`), on the random streams the SFT model's answers were drawn with, with the proxy's and
        a pointwise judge's scores and each answer's KL to the SFT model in the sampling precision, each split
        scored apart: (answers per split, KL per split)."""
        models = self.models
        policy_low = as_precision(models.policy, models.dtype)
        outputs, parts = sample_answers(self.settings, policy_low, models.tokenizer, self.data.prompts, self.lines)
        return parts, self.scored(policy_low, outputs, parts)

    def scored(self, policy_low, outputs, parts: dict[str, Answers]) -> dict[str, np.ndarray]:
        """The proxy's and a pointwise judge's scores of each split's answers (into `parts`), and their KL to the SFT
        model per split."""
        score_answers(parts, self.data.prompts, self.models.rm, self.models.judge)
        sizes = [len(part) for part in parts.values()]
        return dict(zip(parts, np.split(self.kl_to_sft(policy_low, outputs, sizes), np.cumsum(sizes)[:-1])))

    def kl_to_sft(self, policy_low, outputs, sizes: list[int]) -> np.ndarray:
        """Each sampled answer's KL to the SFT model in the sampling precision, each part of `sizes` rows apart."""
        settings, models = self.settings, self.models
        kl = sampled_kl(
            policy_low,
            as_precision(models.sft, models.dtype),
            outputs,
            settings.temperature,
            pad_token_id=models.tokenizer.pad_token_id,
            batch_size=settings.score_batch_size,
            parts=sizes,
            lines=self.lines,
        )
        return np.asarray(kl)

    def answer_dev(self) -> DevAnswers:
        """The policy's answers to the dev prompts alone, for the champion rule of a run that did not answer them up
        front: on the random streams the champion's answers are sampled with (`policy_against`). Their KL to the SFT
        model is measured only where a guard reads it (`evaluate.champion.kl_budget`); NaN otherwise."""
        settings, models, held_out = self.settings, self.models, self.data.prompts
        policy_low = as_precision(models.policy, models.dtype)
        outputs = settings.sampling.sample(policy_low, models.tokenizer, held_out.prompts["dev"], lines=self.lines)
        answers = Answers.from_outputs(outputs, settings.degenerate_repetition)
        kl = math.nan
        if settings.champion.kl_budget is not None:
            kl = float(self.kl_to_sft(policy_low, outputs, [len(answers)]).mean())
        return DevAnswers(held_out.prompts["dev"], held_out.conversations["dev"], answers, kl)

    def split_figures(self, split: str, policy_answers: Answers, sft_answers: Answers):
        """One split's comparison of the policy's answers with the SFT model's: (figures, the judge's verdicts, a
        pointwise judge's scores)."""
        held_out = self.data.prompts
        proxy = verdicts_from_scores(policy_answers.extra["proxy"], sft_answers.extra["proxy"])
        judged, judge_scores = _verdicts(self.models.judge, held_out.prompts[split], policy_answers, sft_answers)
        conversations = held_out.conversations[split]
        metrics = comparison_metrics(
            policy_answers, sft_answers, proxy, judged, conversations, judge_scores, self.settings.missing_eos_penalty
        )
        return metrics | text_metrics(policy_answers) | sft_side(text_metrics(sft_answers)), judged, judge_scores

    def test_metrics(self, kl):
        """The test split's KL with its interval, both perplexities, and the proxy on every test pair:
        (figures, the pairs' verdicts, the calibration buckets)."""
        models, data = self.models, self.data
        batch = self.settings.score_batch_size
        ref_rows = data.test_rows.drop_duplicates("prompt").head(self.settings.perplexity_rows)
        ppl_args = (list(ref_rows["prompt_messages"]), list(ref_rows["chosen"]))
        # the SFT model's figure as the sft stage measured it on the same rows; measured here when it has none
        sft_perplexity = data.sft_perplexity
        if sft_perplexity is None:
            sft_perplexity = perplexity(models.sft, models.tokenizer, *ppl_args, batch_size=batch)
        pair_rows = data.test_rows.to_dict("records")
        # the proxy's scores of these pairs as its stage saved them (the same model, loaded the same way)
        pairs = evaluate_pairs(models.rm, pair_rows, scores=data.test_pair_scores)
        rm_metrics, buckets = reward_model_metrics(pairs, pair_rows)
        conversations = data.prompts.conversations["test"]
        kl_weights = stats.resample_weights(len(kl), clusters=conversations, seed=BOOTSTRAP_SEED)
        metrics = {
            **_with_interval("eval/kl", stats.mean_with_interval(kl, kl_weights)),  # by conversation
            "eval/perplexity": perplexity(models.policy, models.tokenizer, *ppl_args, batch_size=batch),
            "eval/perplexity_sft": sft_perplexity,
            **rm_metrics,
        }
        return metrics, pairs, buckets

    def policy_against(self, result: PolicyEvaluation, other, tokenizer, challenge: int) -> HeadToHead:
        """The evaluated policy head to head with another one (the champion's model, with its own tokenizer: its
        chat template and special tokens, as it would be served) on the dev prompts, sampled with the evaluation's
        settings and judged by the same judge on the pairs where both answers ended, after the guards
        (evaluate.champion)."""
        if result.dev is None:  # the dev split was not answered up front: this decision is the first to read it
            result.dev = self.answer_dev()
        settings, judge, dev = self.settings, self.models.judge, result.dev
        other = as_precision(other, self.models.dtype)
        other_answers = Answers.from_outputs(
            settings.sampling.sample(other, tokenizer, dev.prompts), settings.degenerate_repetition
        )
        mine = dev.answers
        both = np.flatnonzero(mine.is_class("ended") & other_answers.is_class("ended"))
        prompts = [dev.prompts[i] for i in both]
        texts, other_texts = [mine.texts[i] for i in both], [other_answers.texts[i] for i in both]
        verdicts = judge_verdicts(judge, prompts, texts, other_texts)
        rule = settings.champion
        guards = guard_failures(
            rule,
            kl=dev.kl,
            ended=mine.shares()["ended"],
            length_ratio=float(np.mean(mine.tokens)) / max(float(np.mean(other_answers.tokens)), 1e-9),
        )
        return policy_head_to_head(verdicts, [dev.conversations[i] for i in both], rule, challenge, guards)

    def reward_model_against(self, result: PolicyEvaluation, other, challenge: int) -> HeadToHead:
        """The proxy head to head with another reward model (the champion's, loaded) on the dev split's pairs."""
        rows = self.data.dev_rows
        mine, other_pairs = evaluate_pairs(self.models.rm, rows), evaluate_pairs(other, rows)
        conversations = list(conversation_keys(pd.DataFrame(rows)))
        return reward_model_head_to_head(
            mine.correct.tolist(), other_pairs.correct.tolist(), conversations, self.settings.champion, challenge
        )


def answer_samples(held_out, policy_answers: Answers, sft_answers: Answers, judged, judge_scores, kl) -> dict:
    """Per test answer: the prompt, both answers, their classes, proxy and judge figures, the KL."""
    samples = {
        "prompt": held_out.texts["test"],
        "sft_response": sft_answers.texts,
        "ppo_response": policy_answers.texts,
        "sft_class": sft_answers.classes,
        "ppo_class": policy_answers.classes,
        "sft_reward": [float(x) for x in sft_answers.extra["proxy"]],
        "ppo_reward": [float(x) for x in policy_answers.extra["proxy"]],
        "judge_preference": [float(x) for x in judged.preference],
        "kl": [float(x) for x in kl],
    }
    if judge_scores is not None:
        samples["sft_judge"], samples["ppo_judge"] = judge_scores[1], judge_scores[0]
    return samples
