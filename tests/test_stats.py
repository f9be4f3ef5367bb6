"""The evaluation's statistics (rlhflow/evaluation/stats.py): the conversation-clustered bootstrap against the
bootstrap of cluster means and by its coverage, and the length-controlled win rate: its fit against sklearn's, its
coverage when lengths overlap, and its support check when one side is uniformly shorter."""

from __future__ import annotations

import numpy as np
import pytest

from rlhflow.evaluation import stats
from rlhflow.evaluation.stats import (
    difference_interval,
    expected_half_width,
    length_controlled_win_rate,
    mean_interval,
    mean_with_interval,
    percentile_interval,
    resample_weights,
)


def test_resample_weights_draw_whole_clusters():
    clusters = ["a", "a", "b", "c", "c", "c"]
    w = resample_weights(6, clusters, resamples=500, seed=1)
    assert w.shape == (500, 6)
    assert (w[:, 0] == w[:, 1]).all() and (w[:, 3] == w[:, 4]).all() and (w[:, 4] == w[:, 5]).all()
    # three clusters drawn three times: the counts per cluster sum to 3
    assert (w[:, 0] + w[:, 2] + w[:, 3] == 3).all()
    plain = resample_weights(6, resamples=500, seed=1)
    assert (plain.sum(axis=1) == 6).all() and np.array_equal(plain, resample_weights(6, None, 500, seed=1))
    assert not np.array_equal(plain, resample_weights(6, None, 500, seed=2))
    with pytest.raises(ValueError, match="labels"):
        resample_weights(5, clusters)


def test_identical_copies_within_a_cluster_give_the_bootstrap_of_cluster_means():
    """Five identical copies of each of 40 values: per item, the bootstrap believes it has 200 independent values;
    resampled by cluster, each resample's weighted mean is the mean of the drawn clusters' values, i.e. exactly the
    bootstrap of the 40 cluster means."""
    rng = np.random.default_rng(0)
    means = rng.normal(size=40)
    values = np.repeat(means, 5)
    clustered = mean_with_interval(values, resample_weights(200, np.repeat(np.arange(40), 5), seed=3))
    per_item = mean_with_interval(values, resample_weights(200, seed=3))
    of_means = mean_with_interval(means, resample_weights(40, seed=3))
    assert clustered == pytest.approx(of_means, abs=1e-12)
    assert clustered[2] - clustered[1] > 1.8 * (per_item[2] - per_item[1])  # about sqrt(5) = 2.2 times as wide


def test_the_clustered_interval_covers_at_its_nominal_rate_and_the_per_item_one_does_not():
    """Conversations of 1-6 items sharing a conversation effect (intra-cluster correlation 0.8): the clustered
    95% interval of the mean covers the true mean about 95% of the time; the per-item one far less."""
    rng = np.random.default_rng(0)
    covered = {"clustered": 0, "per item": 0}
    runs = 400
    for run in range(runs):
        sizes = rng.integers(1, 7, size=60)
        cluster = np.repeat(np.arange(60), sizes)
        values = rng.normal(size=60)[cluster] + rng.normal(scale=0.5, size=len(cluster))  # true mean 0
        for name, labels in (("clustered", cluster), ("per item", None)):
            _, low, high = mean_with_interval(values, resample_weights(len(values), labels, resamples=500, seed=run))
            covered[name] += low <= 0 <= high
    assert 0.9 <= covered["clustered"] / runs <= 0.98
    assert covered["per item"] / runs < 0.8


def test_paired_statistics_share_the_resamples():
    rng = np.random.default_rng(0)
    a = rng.random(100)
    w = resample_weights(100, resamples=300)
    diff, low, high = difference_interval(a, a - 0.25, w)  # a constant paired difference has no spread
    assert diff == pytest.approx(0.25) and low == pytest.approx(0.25) and high == pytest.approx(0.25)
    wins = (rng.random(100) < 0.6).astype(float)
    rate, low, high = mean_interval(wins, w)
    assert (low, high) == pytest.approx(percentile_interval((w @ wins) / w.sum(1)))
    assert mean_interval(np.ones(10), w[:, :10]) == (1.0, *stats.wilson_interval(10, 10))
    with pytest.raises(ValueError, match="weights must be"):
        mean_with_interval(a, w[:, :50])


def test_expected_half_width_is_the_normal_approximation():
    assert expected_half_width(256) == pytest.approx(1.96 * 0.5 / 16, rel=1e-3)  # +-0.06 at 256 prompts
    assert expected_half_width(385) == pytest.approx(0.05, abs=1e-3)
    assert expected_half_width(64, p=0.9) == pytest.approx(1.96 * 0.3 / 8, rel=1e-3)
    assert np.isnan(expected_half_width(0))


# ---- length-controlled win rate ------------------------------------------------------------------------------------

CHARS_PER_WORD = 5.5


def _judge(rng, d: np.ndarray, model_logit: np.ndarray | float = 0.0) -> np.ndarray:
    """A pointwise judge's soft preference sigmoid(score difference): a model effect, a preference for shorter
    answers that is linear in characters (not the tanh the fit assumes) and per-answer noise."""
    return 1 / (1 + np.exp(-(model_logit - d / 60 + rng.normal(size=len(d)))))


def _outcomes(rng, p: np.ndarray, outcome: str) -> np.ndarray:
    """What the estimator is given: the soft preference itself, or hard verdicts drawn from it (1 with probability
    p, else 0; a tenth of them ties at 0.5), as a win rate counts them."""
    if outcome == "soft":
        return p
    verdicts = (rng.random(len(p)) < p).astype(float)
    verdicts[rng.random(len(p)) < 0.1] = 0.5
    return verdicts


@pytest.mark.parametrize("prompts", [False, True])
def test_the_fit_is_sklearn_s_penalised_logistic_regression(prompts):
    """The Newton solver that refits every resample finds sklearn's LogisticRegression optimum at the chosen C, on the
    soft targets as duplicated rows, with and without per-prompt terms."""
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(0)
    n = 120
    d = rng.normal(0, 200, n)
    p = _judge(rng, d, 0.5)
    prompt = np.repeat(np.arange(40), 3) if prompts else None
    x = stats._length_feature(d, np.ones((1, n)))
    C, start = stats._cross_validated_strength(p, x[0], prompt, 5, seed=0)
    beta = stats._fit_glm(p, x, np.ones((1, n)), prompt, C, np.zeros_like(start))[0]
    scale = stats.LC_MAIN_SCALE
    design = np.stack([np.full(n, scale), scale * x[0], *([] if prompt is None else np.eye(40)[prompt].T)], axis=1)
    sk = LogisticRegression(C=C, l1_ratio=0.0, fit_intercept=False, tol=1e-12, max_iter=10_000)
    sk.fit(np.r_[design, design], np.r_[np.ones(n), np.zeros(n)], sample_weight=np.r_[p, 1 - p])
    expected = sk.coef_[0] * np.r_[scale, scale, np.ones(design.shape[1] - 2)]
    assert beta == pytest.approx(expected, abs=1e-5)


def test_the_length_controlled_win_rate_finds_a_real_effect_when_lengths_overlap():
    """True win rate at equal length 0.7, lengths on both sides of zero: the estimate is near 0.7, supported, and the
    length effect does not leak into it (the raw preference is further from 0.7). With several samples per prompt
    and per-prompt effects, the estimand is the mean over those prompts of the preference at zero difference."""
    rng = np.random.default_rng(0)
    n = 281
    d = rng.normal(150, 250, n)  # the policy longer on average; a quarter of its answers shorter
    # an LLM judge's verdicts: P(policy better) = 0.7 at equal length, more when the policy is longer
    verdict = (rng.random(n) < 1 / (1 + np.exp(-(np.log(0.7 / 0.3) + d / 100)))).astype(float)
    lc = length_controlled_win_rate(verdict, d, resample_weights(n, resamples=500))
    assert lc.supported and lc.reason == ""
    assert lc.value == pytest.approx(0.7, abs=0.05) and lc.low < 0.7 < lc.high
    assert verdict.mean() > 0.75 and abs(lc.value - 0.7) < verdict.mean() - 0.7  # the raw rate is inflated

    prompt_ids = np.repeat(np.arange(94), 3)[:n]  # 3 samples per prompt, a prompt effect each
    u = rng.normal(0, 0.7, 94)[prompt_ids]
    p = _judge(rng, -d, 1.0 + u)  # soft preferences, the judge preferring longer answers
    noise = rng.normal(size=(4000, 1))
    truth = (1 / (1 + np.exp(-(1.0 + u[None, :] + noise)))).mean()  # mean preference at zero difference
    weights = resample_weights(n, prompt_ids, resamples=500)
    lc = length_controlled_win_rate(p, d, weights, prompt_ids=list(prompt_ids))
    assert lc.supported and lc.value == pytest.approx(truth, abs=0.05) and lc.low < truth < lc.high


@pytest.mark.parametrize("outcome", ["soft", "hard"])
def test_a_uniformly_shorter_policy_is_covered_or_flagged(outcome):
    """True win rate 0.5 at equal length; the policy is shorter by 20 +- 12 words (in characters) and the judge
    prefers shorter answers, so the raw preference is far above 0.5 and zero difference lies at the edge of the data
    or beyond it. Over simulated evaluations of 64-281 prompts, the interval covers 0.5 or the result is flagged
    unsupported at least 90% of the time; every flag says why. The same on the soft preference and on hard verdicts
    (1, 0.5, 0) drawn from it."""
    rng = np.random.default_rng(0)
    runs, good, flagged = 200, 0, 0
    for run in range(runs):
        n = int(rng.integers(64, 282))
        d = rng.normal(-20, 12, n) * CHARS_PER_WORD
        p = _outcomes(rng, _judge(rng, d), outcome)
        lc = length_controlled_win_rate(p, d, resample_weights(n, resamples=200, seed=run))
        flagged += not lc.supported
        good += (lc.low <= 0.5 <= lc.high) or not lc.supported
        assert lc.supported or "outside the data" in lc.reason
        assert np.isfinite(lc.value)
    assert good / runs >= 0.9
    assert flagged / runs >= 0.5  # about 5% of pairs on the policy-longer side: mostly flagged


def test_on_hard_verdicts_at_128_prompts_the_interval_covers_and_is_twice_the_soft_one():
    """Hard verdicts (1, 0.5, 0) of a judge preferring shorter answers, lengths on both sides of zero, true win rate
    0.5 at equal length, 128 prompts (the default test split): the 95% interval covers 0.5 in about 95% of
    simulated evaluations, and its half-width is about 0.11, twice that of the same fit on the soft preference the
    verdicts were drawn from (about 0.05), which reads the judge's confidence as data. Figures: docs/evaluation.md."""
    rng = np.random.default_rng(1)
    runs, n, covered, half_widths = 60, 128, 0, {"soft": [], "hard": []}
    for run in range(runs):
        d = rng.normal(0, 40, n) * CHARS_PER_WORD
        p = _judge(rng, d)
        for outcome in ("soft", "hard"):
            lc = length_controlled_win_rate(_outcomes(rng, p, outcome), d, resample_weights(n, resamples=500, seed=run))
            half_widths[outcome].append((lc.high - lc.low) / 2)
            covered += outcome == "hard" and lc.low <= 0.5 <= lc.high
    assert covered / runs >= 0.85
    assert 0.08 < np.mean(half_widths["hard"]) < 0.14 and 0.03 < np.mean(half_widths["soft"]) < 0.07


def test_on_hard_verdicts_a_pure_length_effect_is_removed_and_a_true_value_recovered():
    """Hand-built verdicts (1 or 0) of a judge that goes by length alone, P(policy wins) = sigmoid(-d / 50): the
    policy, mostly shorter, wins most pairs, yet at equal length the judge prefers neither (0.5). The same judge with
    a model effect, logit = logit(0.7) - d / 50, gives back 0.7, where its raw rate is inflated."""
    rng = np.random.default_rng(2)
    n = 281
    d = rng.normal(-100, 150, n)  # the policy shorter on average, longer in about a quarter of the pairs
    weights = resample_weights(n, resamples=500)
    for truth in (0.5, 0.7):
        verdicts = (rng.random(n) < 1 / (1 + np.exp(-(np.log(truth / (1 - truth)) - d / 50)))).astype(float)
        lc = length_controlled_win_rate(verdicts, d, weights)
        assert lc.supported and lc.value == pytest.approx(truth, abs=0.05) and lc.low < truth < lc.high
        assert verdicts.mean() - truth > 0.1  # the raw rate carries the length effect


def test_the_length_controlled_win_rate_handles_the_edges():
    w = resample_weights(30, resamples=100)
    lc = length_controlled_win_rate(np.ones(30), np.linspace(-50, 50, 30), w)  # every prompt won: finite, near 1
    assert 0.9 < lc.value < 1 and lc.low <= lc.value <= lc.high and lc.supported
    lc = length_controlled_win_rate(np.full(30, 0.5), np.zeros(30), w)  # equal lengths: no length term to fit
    assert lc.value == pytest.approx(0.5, abs=1e-6) and lc.supported
    lc = length_controlled_win_rate([1.0], [3.0], w[:, :1])
    assert not lc.supported and np.isnan(lc.value)


def test_the_difference_at_equal_x_removes_what_x_explains():
    """Two settings on one line y = 1 + 2 x, the second 0.3 higher: the fit finds 0.3 whatever their x, though the
    plain difference of means mixes in their different x; noise widens the interval, which holds the truth."""
    x = np.array([1.0, 2.0, 3.0, 2.0, 3.0, 4.0])
    second = np.array([False, False, False, True, True, True])
    y = 1 + 2 * x + 0.3 * second
    value, low, high = stats.difference_at_equal_x(x, y, second)
    assert value == pytest.approx(0.3) and low == pytest.approx(0.3) and high == pytest.approx(0.3)
    assert y[second].mean() - y[~second].mean() == pytest.approx(2.3)
    noisy = y + np.array([0.05, -0.05, 0.02, -0.02, 0.04, -0.04])
    value, low, high = stats.difference_at_equal_x(x, noisy, second)
    assert low < 0.3 < high and high - low > 0
    assert np.isnan(stats.difference_at_equal_x(x[:3], y[:3], second[:3])[1])  # too few runs for an interval
