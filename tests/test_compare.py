"""The evaluation's comparison of a policy with the SFT model's answers (rlhflow/evaluation/compare.py), on answers
made up here: which pairs count as both ended, what the win rates are, when the length control is unsupported."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlhflow.evaluation.answers import Answers
from rlhflow.evaluation.compare import comparison_metrics, verdicts_from_scores
from rlhflow.evaluation.held_out import evaluation_prompts
from rlhflow.evaluation.judges import Verdicts


def answers(classes: list[str], proxy: list[float], texts: list[str] | None = None) -> Answers:
    n = len(classes)
    return Answers(
        texts=texts or ["word " * 5] * n,
        ended=[c != "cut" for c in classes],
        tokens=[10] * n,
        repetition=[0.0] * n,
        classes=classes,
        extra={"proxy": proxy},
    )


def test_win_rates_overall_and_where_both_ended():
    # 4 prompts: the policy ends everywhere; the SFT model is cut on the two the policy wins
    policy = answers(["ended"] * 4, [1.0, 1.0, 0.0, 0.0])
    sft = answers(["cut", "cut", "ended", "ended"], [0.0, 0.0, 1.0, 1.0])
    proxy = verdicts_from_scores(policy.extra["proxy"], sft.extra["proxy"])
    metrics = comparison_metrics(policy, sft, proxy, proxy, ["a", "b", "c", "d"], missing_eos_penalty=1.0)
    assert metrics["eval/win_rate_vs_sft"] == 0.5
    assert metrics["eval/both_ended_prompts"] == 2
    assert metrics["eval/judge_win_rate_both_ended"] == 0.0  # where both finished, the SFT answers won
    assert metrics["eval/prompts"] == 4
    assert metrics["eval/expected_half_width"] == pytest.approx(1.96 * 0.5 / 2, rel=1e-3)
    # the score PPO optimised: the SFT side pays the missing-EOS penalty on its two cut answers
    assert metrics["eval/objective_mean"] == 0.5 and metrics["eval/objective_mean_sft"] == 0.0


def test_soft_preference_is_the_bradley_terry_probability():
    verdicts = verdicts_from_scores([2.0, 0.0, 1.0], [0.0, 2.0, 1.0])
    assert verdicts.wins.tolist() == [1.0, 0.0, 0.5]
    assert verdicts.preference == pytest.approx([1 / (1 + np.exp(-2)), 1 / (1 + np.exp(2)), 0.5])


def test_win_rates_and_their_length_control_are_on_hard_verdicts_and_the_soft_scale_is_named_apart():
    """Scores that differ little but always favour the policy: every hard verdict a win (win rate 1, length-controlled
    near 1), the soft preference near 0.5 (a reward model's sigmoid of a small difference). The soft figures come
    under their own names, and a judge that gives only verdicts (an LLM's) has none."""
    n = 40
    texts = [("x" * (50 + 10 * i), "x" * (400 - 5 * i)) for i in range(n)]  # lengths on both sides of equal
    policy = answers(["ended"] * n, [0.02] * n, [t[0] for t in texts])
    sft = answers(["ended"] * n, [0.0] * n, [t[1] for t in texts])
    graded = verdicts_from_scores(policy.extra["proxy"], sft.extra["proxy"])
    metrics = comparison_metrics(policy, sft, graded, graded, [f"c{i}" for i in range(n)])
    assert metrics["eval/judge_win_rate_vs_sft"] == 1.0 and metrics["eval/judge_win_rate_lc"] > 0.95
    assert metrics["eval/judge_soft_preference"] == pytest.approx(1 / (1 + np.exp(-0.02)))
    assert abs(metrics["eval/judge_soft_preference_lc"] - 0.5) < 0.01 and "eval/soft_preference_lc" in metrics

    verdicts_only = Verdicts(wins=graded.wins, preference=graded.wins)  # an LLM judge's: the verdict again
    metrics = comparison_metrics(policy, sft, graded, verdicts_only, [f"c{i}" for i in range(n)])
    assert metrics["eval/judge_win_rate_lc"] > 0.95 and not any("judge_soft" in k for k in metrics)


def test_a_uniformly_shorter_policy_gets_an_unsupported_length_control():
    rng = np.random.default_rng(0)
    n = 64
    sft_texts = ["x" * int(rng.integers(150, 300)) for _ in range(n)]
    policy_texts = ["x" * int(rng.integers(20, 60)) for _ in range(n)]  # always shorter
    policy = answers(["ended"] * n, rng.normal(0.5, 1, n).tolist(), policy_texts)
    sft = answers(["ended"] * n, rng.normal(0, 1, n).tolist(), sft_texts)
    proxy = verdicts_from_scores(policy.extra["proxy"], sft.extra["proxy"])
    metrics = comparison_metrics(policy, sft, proxy, proxy, [f"c{i}" for i in range(n)])
    assert metrics["eval/judge_win_rate_lc_supported"] == 0.0 and metrics["eval/win_rate_lc_supported"] == 0.0
    assert "eval/judge_win_rate_lc" in metrics  # still reported, flagged


def test_clustered_intervals_are_wider_when_a_conversation_repeats():
    policy = answers(["ended"] * 40, [1.0, 0.0] * 20)
    sft = answers(["ended"] * 40, [0.5] * 40)
    proxy = verdicts_from_scores(policy.extra["proxy"], sft.extra["proxy"])
    per_item = comparison_metrics(policy, sft, proxy, proxy, [f"c{i}" for i in range(40)])
    # the same 40 answers from 4 conversations of 10 answers each, and each conversation's answers alike
    policy_clustered = answers(["ended"] * 40, [1.0] * 20 + [0.0] * 20)
    proxy_c = verdicts_from_scores(policy_clustered.extra["proxy"], sft.extra["proxy"])
    clustered = comparison_metrics(policy_clustered, sft, proxy_c, proxy_c, [f"c{i // 10}" for i in range(40)])
    assert per_item["eval/win_rate_vs_sft"] == clustered["eval/win_rate_vs_sft"] == 0.5
    assert clustered["eval/win_rate_ci_high"] - clustered["eval/win_rate_ci_low"] > 1.5 * (
        per_item["eval/win_rate_ci_high"] - per_item["eval/win_rate_ci_low"]
    )
    assert clustered["eval/prompts"] == 4


def test_one_prompt_per_test_conversation(tmp_path):
    rows = [
        {"prompt": "hi", "prompt_messages": [{"role": "user", "content": "Hi"}], "chosen": "a", "rejected": "b"},
        {  # the same conversation, one turn deeper
            "prompt": "hi more",
            "prompt_messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "a"},
                {"role": "user", "content": "more"},
            ],
            "chosen": "c",
            "rejected": "d",
        },
        {"prompt": "other", "prompt_messages": [{"role": "user", "content": "Other"}], "chosen": "e", "rejected": "f"},
    ]
    test = tmp_path / "test.jsonl"
    test.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = evaluation_prompts(test, None)
    assert list(prompts["prompt"]) == ["hi", "other"]
    assert list(evaluation_prompts(test, 1)["prompt"]) == ["hi"]


def test_answers_sampled_another_way_are_refused(tmp_path):
    from rlhflow.config.params import load_config
    from rlhflow.evaluation.held_out import REFERENCE_FILE, HeldOutPrompts, load_reference
    from tasks.evaluate import read_held_out_data
    from tasks.evaluation_setup import evaluation_inputs, evaluation_settings, sft_answers_key

    test = tmp_path / "validated/test.jsonl"
    test.parent.mkdir()
    test.write_text(json.dumps({"prompt": "p", "prompt_messages": [{"role": "user", "content": "p"}]}) + "\n")
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft/model.safetensors").write_text("weights")
    cfg = load_config(
        overrides=[
            f"validate.out_dir={tmp_path}/validated",
            f"sft.out_dir={tmp_path}/sft",
            f"evaluate.reference_dir={tmp_path}/answers",
        ]
    )
    settings = evaluation_settings(cfg)
    with pytest.raises(FileNotFoundError, match="run the sft_answers stage"):
        read_held_out_data(evaluation_inputs(cfg))
    (tmp_path / "answers").mkdir()
    record = {
        "key": {"sft_md5": "another model", "test_md5": "x", "prompts": 1, "sampling": {}, "precision": "auto"},
        "answers": answers(["ended"], [0.0]).to_json(),
    }
    (tmp_path / "answers" / REFERENCE_FILE).write_text(json.dumps(record))
    held_out = HeldOutPrompts.load({"test": test}, None, 1)
    with pytest.raises(ValueError, match="sft_md5") as error:
        load_reference(
            tmp_path / "answers" / REFERENCE_FILE, sft_answers_key(settings, held_out, {"test": test}, tmp_path / "sft")
        )
    assert "sampling" in str(error.value) and "rerun the sft_answers stage" in str(error.value)
