"""Best-of-n from the SFT model as the frontier's baseline (rlhflow/frontier.py): the exact order-statistics
estimator against brute force over every n-subset, the analytic KL, and the table and plot."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from rlhflow.frontier import (
    FrontierPoint,
    best_of_n_frontier,
    best_of_n_kl,
    best_of_n_scores,
    best_of_n_weights,
    frontier_plot,
    frontier_table,
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
