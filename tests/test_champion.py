"""The champion rule's error rate and power (rlhflow/evaluation/champion.py), its guards, and that every choice reads
the dev split, never the test split."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from rlhflow.config.evaluate import ChampionConfig
from rlhflow.evaluation.champion import (
    HeadToHead,
    alpha_spent,
    binomial_upper_tail,
    guard_failures,
    promotion_power,
    sign_test,
)

DOCS = Path(__file__).resolve().parents[1] / "docs"
DEV_CONVERSATIONS = 140  # the shipped data's dev split (validate.dev_fraction 0.1)


def _simulated_challenges(rng, challenges: range, win: float, tie: float, replications: int) -> np.ndarray:
    """[replications] booleans: was any of the challenges promoted, each challenger's verdict per conversation a win
    (1), a tie (0.5) or a loss (0) drawn with the given probabilities, decided through sign_test and HeadToHead."""
    promoted = np.zeros(replications, dtype=bool)
    conversations = [f"c{i}" for i in range(DEV_CONVERSATIONS)]
    for r in range(replications):
        for k in challenges:
            verdicts = rng.choice([1.0, 0.5, 0.0], size=DEV_CONVERSATIONS, p=[win, tie, 1 - win - tie])
            h2h = HeadToHead(
                "m", float(verdicts.mean()), 0, 1, sign_test(verdicts, conversations), alpha_spent(0.05, k), k
            )
            if h2h.challenger_wins:
                promoted[r] = True
                break
    return promoted


def test_twenty_challengers_equal_to_the_champion_promote_at_most_five_percent_of_the_time_in_total():
    rng = np.random.default_rng(0)
    replications = 3000
    promoted = _simulated_challenges(rng, range(1, 21), win=0.4, tie=0.2, replications=replications)
    rate = promoted.mean()
    assert rate <= 0.05, rate
    # the exact figure the docs derive from: the sum of each challenge's exact type-I error
    exact = sum(promotion_power(DEV_CONVERSATIONS, 0.4, 0.2, alpha_spent(0.05, k)) for k in range(1, 21))
    assert exact <= 0.05
    assert abs(rate - exact) < 4 * math.sqrt(exact * (1 - exact) / replications) + 0.005  # union bound is near-tight
    # a fixed 95% rule on every challenge would not hold: 1 - 0.975^20 = 0.40 in the words
    assert sum(alpha_spent(0.05, k) for k in range(1, 10_000)) < 0.05


@pytest.mark.parametrize("challenge,win", [(1, 0.48), (5, 0.52), (10, 0.56)])
def test_a_better_challenger_is_promoted_with_the_power_the_docs_state(challenge, win):
    """Simulated power equals promotion_power, and docs/mlflow.md states that figure."""
    rng = np.random.default_rng(challenge)
    replications = 1500
    promoted = _simulated_challenges(rng, range(challenge, challenge + 1), win=win, tie=0.2, replications=replications)
    power = promotion_power(DEV_CONVERSATIONS, win, 0.2, alpha_spent(0.05, challenge))
    assert abs(promoted.mean() - power) < 4 * math.sqrt(power * (1 - power) / replications) + 0.01
    table = (DOCS / "mlflow.md").read_text()
    row = re.search(rf"^\| {challenge} \|.*$", table, flags=re.M)
    assert row, f"docs/mlflow.md has no power row for challenge {challenge}"
    column = {0.44: 3, 0.48: 4, 0.52: 5, 0.56: 6}[win]
    assert row.group(0).split("|")[column].strip() == f"{power:.2f}", row.group(0)


def test_the_sign_test_counts_a_conversation_once_and_drops_ties():
    # two samples of conversation a both won, b tied overall, c lost
    test = sign_test([1, 1, 1, 0, 0], ["a", "a", "b", "b", "c"])
    assert (test.wins, test.losses, test.ties) == (1, 1, 1)
    assert test.p_value == pytest.approx(0.75)
    assert binomial_upper_tail(9, 10) == pytest.approx(11 / 1024)
    # a paired difference (reward models): +1 challenger right only, -1 champion right only, 0 both alike
    diff = sign_test([1, 1, 0, -1, 1], ["a", "b", "c", "d", "e"], tie=0.0)
    assert (diff.wins, diff.losses, diff.ties) == (3, 1, 1)


def test_guards_keep_a_challenger_out_whatever_it_wins():
    rule = ChampionConfig(alpha=0.05, kl_budget=5.0, min_ended=0.8, max_length_ratio=1.5)
    assert guard_failures(rule, kl=4.0, ended=0.9, length_ratio=1.2) == ()
    failed = guard_failures(rule, kl=6.0, ended=0.5, length_ratio=0.5)
    assert len(failed) == 3
    assert "KL to SFT 6 nats is over the budget 5" in failed[0]
    assert "ended share 0.500 is under 0.8" in failed[1]
    assert "length ratio to the champion 0.50 is outside [0.67, 1.5]" in failed[2]
    certain = sign_test([1.0] * 100, [str(i) for i in range(100)])
    shorter = HeadToHead("m", 1.0, 0.96, 1.0, certain, level=0.03, challenge=1, guards_failed=failed[2:])
    assert certain.p_value < 1e-20 and not shorter.challenger_wins
    assert "guards failed: length ratio" in str(shorter)
    assert not guard_failures(
        ChampionConfig(kl_budget=None, min_ended=None, max_length_ratio=None), kl=99, ended=0, length_ratio=9
    )


def test_the_champion_rule_settings_are_read_from_params():
    from rlhflow.config.params import ConfigError, load_config

    cfg = load_config(overrides=["evaluate.champion.kl_budget=8", "evaluate.champion.alpha=0.01"])
    rule = cfg.evaluate.champion
    assert rule.kl_budget == 8 and rule.alpha == 0.01 and rule.min_ended == 0.5
    with pytest.raises(ConfigError, match="evaluate.champion.max_length_ratio"):
        load_config(overrides=["evaluate.champion.max_length_ratio=0.5"])


# ---- choices read the dev split only ------------------------------------------------------------------------------


def _outputs(texts: list[str], ended: list[bool]):
    import torch

    response = torch.tensor([[5 + i, 6 + i, 7 + i] for i in range(len(texts))])
    return [SimpleNamespace(response=response, response_mask=torch.ones_like(response), ended=ended, texts=texts)]


@pytest.mark.parametrize("answered_up_front", [True, False])
def test_the_policy_champion_comparison_reads_only_dev_prompts(answered_up_front):
    """Whatever the challenger is compared with, the prompts sampled and judged are the dev split's. A run that did
    not answer the dev split up front (evaluate.dev_figures false) samples the challenger's dev answers there, on
    the streams the champion's are sampled with, and measures no KL that no guard reads."""
    import dataclasses

    import torch

    from rlhflow.config.params import load_config
    from rlhflow.evaluation import compare
    from rlhflow.evaluation.answers import Answers
    from tasks.evaluation_setup import evaluation_settings

    dev_prompts = [[{"role": "user", "content": f"dev question {i}"}] for i in range(4)]
    sampled, judged = [], []
    champion, challenger = object(), object()

    class Sampling:
        def sample(self, model, tokenizer, prompts, lines=None):
            sampled.append((model, prompts))
            if model is challenger:
                return _outputs([f"challenger {i}" for i in range(len(prompts))], [True] * 4)
            return _outputs([f"champion {i}" for i in range(len(prompts))], [True, True, False, True])

    class Judge:
        pointwise = True

        def score(self, prompts, texts):
            judged.extend(prompts)
            return np.array([1.0 if t.startswith("challenger") else 0.0 for t in texts])

    mine = Answers.from_outputs(_outputs([f"challenger {i}" for i in range(4)], [True] * 4), 0.5)
    dev = compare.DevAnswers(dev_prompts, ["a", "b", "c", "d"], mine, kl=3.0) if answered_up_front else None
    result = compare.PolicyEvaluation({}, {}, [], None, dev)
    settings = dataclasses.replace(evaluation_settings(load_config()), sampling=Sampling())
    models = compare.EvaluatedModels("cpu", torch.float32, None, None, challenger, None, Judge())
    held_out = SimpleNamespace(prompts={"dev": dev_prompts}, conversations={"dev": ["a", "b", "c", "d"]})
    evaluator = compare.PolicyEvaluator(settings, models, data=SimpleNamespace(prompts=held_out))
    h2h = evaluator.policy_against(result, other=champion, tokenizer=None, challenge=1)
    expected = [(champion, dev_prompts)] if answered_up_front else [(challenger, dev_prompts), (champion, dev_prompts)]
    assert sampled == expected
    assert judged and all(p in dev_prompts for p in judged)
    assert (h2h.test.wins, h2h.test.losses, h2h.test.ties) == (3, 0, 0)  # the pair where the champion was cut drops
    assert h2h.metric == "judge win rate over the champion, both ended"
    assert result.dev.kl == 3.0 if answered_up_front else math.isnan(result.dev.kl)  # kl_budget unset: not measured


def test_dev_figures_are_named_apart_from_the_reported_ones():
    from rlhflow.evaluation.compare import dev_metrics

    test_like = {
        "eval/judge_win_rate_both_ended": 0.6,
        "eval/judge_win_rate_vs_sft": 0.7,
        "eval/judge_win_rate_lc_supported": 1.0,
        "eval/answers_ended": 0.9,
        "eval/answers_ended_sft": 0.8,  # the SFT side is not a choice figure
        "eval/perplexity": 12.0,  # nor is perplexity
        "eval/win_rate_vs_sft": math.nan,
    }
    assert dev_metrics(test_like, kl=2.5) == {
        "dev/judge_win_rate_both_ended": 0.6,
        "dev/judge_win_rate_vs_sft": 0.7,
        "dev/judge_win_rate_lc_supported": 1.0,
        "dev/answers_ended": 0.9,
        "dev/kl": 2.5,
    }


def test_splits_hold_dev_and_test_apart_and_keep_train_and_judge_as_before():
    import pandas as pd

    from rlhflow.data.splits import assign_splits, conversation_keys

    df = pd.DataFrame(
        {
            "prompt": [f"question {i}" for i in range(2000)],
            "prompt_messages": [[{"role": "user", "content": f"question {i}"}] for i in range(2000)],
            "chosen": ["a"] * 2000,
            "rejected": ["b"] * 2000,
        }
    )
    with_dev = assign_splits(df, test_fraction=0.1, dev_fraction=0.1, judge_fraction=0.25, seed=0)
    without = assign_splits(df, test_fraction=0.2, judge_fraction=0.25, seed=0)
    assert list(with_dev) == ["train", "judge", "dev", "test"]
    keys = {split: set(conversation_keys(frame)) for split, frame in with_dev.items()}
    for a in keys:
        for b in keys:
            assert a == b or not keys[a] & keys[b], (a, b)
    # the held-out conversations are the same as with one 0.2 test split: train and judge do not move
    assert keys["dev"] | keys["test"] == set(conversation_keys(without["test"]))
    assert with_dev["train"].equals(without["train"]) and with_dev["judge"].equals(without["judge"])
    assert 150 < len(with_dev["dev"]) < 250 and 150 < len(with_dev["test"]) < 250
