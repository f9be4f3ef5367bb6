"""Best-of-n from the SFT model as the frontier's baseline (rlhflow/evaluation/frontier.py): the exact order-statistics
estimator against brute force over every n-subset, selection by PPO's objective (proxy minus the missing-EOS
penalty), the analytic KL, and the table and plot."""

from __future__ import annotations

import itertools
import math
import types

import numpy as np
import pytest

from rlhflow.evaluation.frontier import (
    FrontierPoint,
    best_of_n_frontier,
    best_of_n_kl,
    best_of_n_scores,
    best_of_n_weights,
    frontier_plot,
    frontier_table,
    objective_name,
    objective_scores,
    sample_best_of_n_scores,
)


def test_best_of_n_kl_is_the_analytic_value():
    assert best_of_n_kl(1) == 0.0
    assert best_of_n_kl(2) == pytest.approx(math.log(2) - 0.5)
    assert best_of_n_kl(16) == pytest.approx(math.log(16) - 15 / 16)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_best_of_n_scores_equal_the_mean_over_every_subset(n):
    rng = np.random.default_rng(n)
    proxy, judge = rng.normal(size=(4, 6)), rng.normal(size=(4, 6))
    assert best_of_n_weights(n, 6).sum() == pytest.approx(1.0)
    got_proxy, got_judge = best_of_n_scores(proxy, judge, n)
    for p in range(4):
        subsets = list(itertools.combinations(range(6), n))
        picks = [max(s, key=lambda i: proxy[p, i]) for s in subsets]  # the proxy picks, the judge scores the pick
        assert got_proxy[p] == pytest.approx(np.mean([proxy[p, i] for i in picks]))
        assert got_judge[p] == pytest.approx(np.mean([judge[p, i] for i in picks]))


def test_the_frontier_table_and_plot(tmp_path):
    rng = np.random.default_rng(0)
    proxy = rng.normal(size=(20, 8))
    judge = proxy + rng.normal(size=(20, 8))
    baseline = best_of_n_frontier(proxy, judge, [1, 2, 4, 8])
    assert [p.label for p in baseline] == ["n=1", "n=2", "n=4", "n=8"]
    assert baseline[0].kl == 0 and baseline[0].proxy_reward[0] == pytest.approx(proxy.mean())
    assert [p.proxy_reward[0] for p in baseline] == sorted(p.proxy_reward[0] for p in baseline)  # more n, more reward
    assert all(p.proxy_reward[1] <= p.proxy_reward[0] <= p.proxy_reward[2] for p in baseline)
    policy = FrontierPoint("ppo", "ppo.kl_coef=0.1", 4.0, (0.5, 0.3, 0.7), (0.2, 0.0, 0.4), {"eos_fraction": 0.8})
    table = frontier_table(baseline + [policy])
    assert "| ppo | ppo.kl_coef=0.1 | 4.00 | 2.00 | 0.500 (0.300 to 0.700) | 0.200 (0.000 to 0.400) | 0.800 |" in table
    fig = frontier_plot(baseline + [policy])
    fig.savefig(tmp_path / "frontier.png")
    assert (tmp_path / "frontier.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="1 <= n <= samples"):
        best_of_n_weights(9, 8)


def test_best_of_n_selects_by_the_objective_ppo_optimised():
    """A response that never ended loses missing_eos_penalty, as in PPO: best-of-n picks by proxy - penalty *
    not_ended and reports that objective; the judge scores the objective's pick."""
    rng = np.random.default_rng(1)
    proxy, judge = rng.normal(size=(5, 6)), rng.normal(size=(5, 6))
    ended = rng.random((5, 6)) < 0.5
    ended[:, 0] = True
    proxy[:, 1], ended[:, 1] = 10.0, False  # the proxy's favourite never ended
    objective = objective_scores(proxy, ended, 20.0)
    assert np.allclose(objective, proxy - 20.0 * ~ended)
    assert np.array_equal(objective_scores(proxy, None, None), proxy)  # no penalty: the proxy
    points = best_of_n_frontier(proxy, judge, [1, 2, 6], ended=ended, missing_eos_penalty=20.0)
    for point, n in zip(points, [1, 2, 6]):
        subsets = list(itertools.combinations(range(6), n))
        picks = [[max(s, key=lambda i: objective[p, i]) for s in subsets] for p in range(5)]
        assert point.proxy_reward[0] == pytest.approx(
            np.mean([[objective[p, i] for i in pk] for p, pk in enumerate(picks)])
        )
        assert point.judge_reward[0] == pytest.approx(
            np.mean([[judge[p, i] for i in pk] for p, pk in enumerate(picks)])
        )
        assert point.extra["eos_fraction"] == pytest.approx(
            np.mean([[ended[p, i] for i in pk] for p, pk in enumerate(picks)])
        )
    assert points[-1].extra["eos_fraction"] == 1.0  # best of all six never picks the one that did not end
    unpenalised = best_of_n_frontier(proxy, judge, [6])[0]
    assert unpenalised.proxy_reward[0] == pytest.approx(10.0)  # by the raw proxy the unended answer wins
    with pytest.raises(ValueError, match="ended flag"):
        objective_scores(proxy, None, 1.0)


def test_the_table_and_plot_name_the_objective(tmp_path):
    assert objective_name(None) == "proxy"
    name = objective_name(1.0)
    assert "proxy - missing_eos_penalty * not_ended" in name and "1" in name
    rng = np.random.default_rng(0)
    points = best_of_n_frontier(rng.normal(size=(8, 4)), rng.normal(size=(8, 4)), [1, 4], ended=np.ones((8, 4)))
    assert f"optimised reward: {name} (95% CI)" in frontier_table(points, name)
    fig = frontier_plot(points, name)
    assert name in fig.axes[0].get_title()
    fig.savefig(tmp_path / "frontier.png")


def test_sample_best_of_n_scores_returns_each_sample_s_ended_flag():
    """Samples, scores and ended flags come back as [prompts, samples] arrays in the same order."""
    import torch

    class Sampling:  # two batches, as the evaluation's sampling returns them
        def sample(self, model, tokenizer, prompts):
            texts = [f"answer {i}" for i in range(len(prompts))]
            ended = torch.tensor([i % 3 != 0 for i in range(len(prompts))])
            return [
                types.SimpleNamespace(texts=texts[:4], ended=ended[:4]),
                types.SimpleNamespace(texts=texts[4:], ended=ended[4:]),
            ]

    class Scorer:
        def __init__(self, offset):
            self.offset = offset

        def score(self, prompts, texts):
            return [self.offset + int(t.split()[1]) for t in texts]

    proxy, judge, ended = sample_best_of_n_scores(None, None, ["a", "b"], Scorer(0), Scorer(100), Sampling(), samples=3)
    assert proxy.tolist() == [[0, 1, 2], [3, 4, 5]] and judge.tolist() == [[100, 101, 102], [103, 104, 105]]
    assert ended.tolist() == [[False, True, True], [False, True, True]]
