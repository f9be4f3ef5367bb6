"""bench/align_compare.py: the algorithms' budgets are equal before any run, each algorithm's beta is swept, and on a
real MLflow store the table takes each point's newest finished pipeline run per seed, with intervals."""

from __future__ import annotations

import mlflow
import pytest

from bench import align_compare
from rlhflow.config.align import training_budget
from rlhflow.config.params import load_config
from rlhfops import tracking


@pytest.fixture
def store(tmp_path):
    return [f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db"]


def log_point(cfg, stage_seconds: float, judge_win_rate: float, kl: float = 2.5, status: str = "FINISHED") -> None:
    with tracking.pipeline_run(cfg) as parent:
        mlflow.log_metrics(
            {
                "eval/kl": kl,
                "eval/kl_ci_low": kl - 0.5,
                "eval/kl_ci_high": kl + 0.5,
                "eval/judge_win_rate_vs_sft": judge_win_rate,
                "eval/judge_win_rate_ci_low": judge_win_rate - 0.1,
                "eval/judge_win_rate_ci_high": judge_win_rate + 0.1,
            }
        )
        with tracking.stage_run(cfg, "ppo", ["align"], parent_run_id=parent.info.run_id):
            mlflow.log_metric("time/ppo_s", stage_seconds)
        if status != "FINISHED":
            mlflow.end_run(status=status)


def test_the_equal_budget_settings_give_every_online_algorithm_the_same_budget():
    """160 responses to 40 prompts in 40 optimiser steps for PPO, GRPO and RLOO; checked on the settings themselves."""
    for algorithm in align_compare.ONLINE:
        cfg = load_config(overrides=align_compare.algorithm_overrides(algorithm, []))
        assert training_budget(algorithm, cfg.ppo, cfg.align) == {
            "responses": 160,
            "prompts": 40,
            "optimizer_steps": 40,
        }
    # the algorithms' own defaults are not like for like: PPO 160 prompts and 40 steps, GRPO 40 prompts and 20 steps
    cfg = load_config()
    assert training_budget("ppo", cfg.ppo, cfg.align) == {"responses": 160, "prompts": 160, "optimizer_steps": 40}
    assert training_budget("grpo", cfg.ppo, cfg.align) == {"responses": 160, "prompts": 40, "optimizer_steps": 20}


def test_unequal_budgets_stop_the_comparison_before_any_run(store, monkeypatch):
    ran = []
    monkeypatch.setattr("flows.sweep.rlhf_sweep", lambda **kw: ran.append(kw))
    with pytest.raises(
        SystemExit,
        match=r"nothing was run: ppo beta 0.05: \{'responses': 80, .*grpo beta 0.04: \{'responses': 160",
    ):
        align_compare.main(
            ["--algorithms", "ppo,grpo", "--set", "ppo.steps=10", *sum([["--set", o] for o in store], [])]
        )
    assert ran == []


def test_betas_are_multiples_of_each_algorithms_default_and_seeds_follow_the_sweep(store):
    points = align_compare.make_points(["ppo", "grpo"], store, [0.5, 1.0], seeds=2)
    assert [(p.algorithm, p.beta, p.seed) for p in points] == [
        ("ppo", "0.025", 0),
        ("ppo", "0.025", 1),
        ("ppo", "0.05", 0),
        ("ppo", "0.05", 1),
        ("grpo", "0.02", 0),
        ("grpo", "0.02", 1),
        ("grpo", "0.04", 0),
        ("grpo", "0.04", 1),
    ]
    assert points[1].cfg.ppo.kl_coef == 0.025 and points[1].cfg.seed == 1 and points[1].cfg.ppo.samples_per_prompt == 4
    assert points[-1].cfg.align.grpo.beta == 0.04 and points[-1].cfg.align.steps_per_generation == 2


def test_each_benchs_points_are_the_runs_its_sweep_makes_by_params_digest(store):
    """The benches find the runs of the sweeps they start by params digest: a point's config is the one the sweep
    runs for it (the sweep's own overrides included), or no run is ever found."""
    from bench import arm_frontier
    from flows.sweep_flow import sweep_points

    def sweep_digests(overrides: list[str], grid: dict[str, list[str]]) -> list[str]:
        return sorted(map(tracking.params_digest, sweep_points(load_config(), overrides, grid, 2)[2]))

    points = arm_frontier.make_points("ppo.precision", ["fp32", "bf16"], store, [1.0, 0.5], 2)
    grid = {"ppo.precision": ["fp32", "bf16"], "ppo.kl_coef": ["0.05", "0.025"]}
    assert sorted(tracking.params_digest(p.cfg) for p in points) == sweep_digests(store, grid)
    points = align_compare.make_points(["ppo"], store, [0.5, 1.0], seeds=2)
    overrides, grid = align_compare.algorithm_overrides("ppo", store), {"ppo.kl_coef": ["0.025", "0.05"]}
    assert sorted(tracking.params_digest(p.cfg) for p in points) == sweep_digests(overrides, grid)


def test_the_table_aggregates_seeds_and_reads_each_points_newest_finished_run(store):
    points = align_compare.make_points(["ppo", "grpo", "rloo"], store, [1.0], seeds=2)
    ppo0, ppo1, grpo0, grpo1 = (p.cfg for p in points[:4])
    tracking.setup(ppo0)
    log_point(ppo0, 400.0, 0.60)
    log_point(ppo0, 420.0, 0.80, kl=3.0)  # newer: this one counts for seed 0
    log_point(ppo1, 440.0, 0.90, kl=5.0)
    log_point(grpo0, 500.0, 0.75)
    log_point(grpo1, 500.0, 0.75, status="FAILED")  # not finished: one of two seeds found
    rows = align_compare.table(points).splitlines()[2:]
    # two seeds: the mean and its t interval, 0.85 +- 12.706 * 0.0707 / sqrt(2) = 0.85 +- 0.635
    assert rows[0].startswith("| ppo | 0.05 | 2/2 | 160 | 40 | 40 | 430 | 0.850 (0.215 to 1.485) |")
    assert "| 4.000 (-8.706 to 16.706) |" in rows[0]  # KL 3 and 5
    # one seed found: its own bootstrap interval
    assert rows[1].startswith("| grpo | 0.04 | 1/2 | 160 | 40 | 40 | 500 | 0.750 (0.650 to 0.850) |")
    assert "| 2.500 (2.000 to 3.000) |" in rows[1]
    assert "no finished run" in rows[2] and rows[2].startswith("| rloo | 0.05 | 0/2 |")


def test_dpo_equal_time_steps_from_ppo_and_dpo_stage_times(store):
    """PPO's wall time is the mean over its seeds; DPO's seconds per step come from all its finished runs at the
    first DPO point's settings, any step count."""
    points = align_compare.make_points(["ppo", "dpo"], store, [1.0], seeds=2)
    ppo0, ppo1, dpo0, dpo1 = (p.cfg for p in points)
    tracking.setup(ppo0)
    assert align_compare.dpo_equal_time_steps(points) is None  # needs both runs
    log_point(ppo0, 400.0, 0.85)
    log_point(ppo1, 440.0, 0.80)
    assert align_compare.dpo_equal_time_steps(points) is None
    log_point(dpo0, 1000.0, 0.58)
    log_point(dpo1, 9999.0, 0.58)  # the first DPO point's seed alone is read
    # DPO ran 20 steps in 1000 s: 50 s a step, so PPO's 420 s (the mean of 400 and 440) buy 8 of them
    assert dpo0.align.steps == 20
    assert align_compare.dpo_equal_time_steps(points) == (8, {20: 1000.0})
    # and 8 steps in 200 s: 1200 s for 28 steps, 42.9 s a step, so 420 s buy 9.8 steps
    log_point(load_config(overrides=[*points[2].overrides, "align.steps=8"]), 200.0, 0.55)
    assert align_compare.dpo_equal_time_steps(points) == (10, {8: 200.0, 20: 1000.0})


def test_curves_order_each_algorithms_points_by_kl_and_the_plot_draws_one_line_per_algorithm(store):
    points = align_compare.make_points(["ppo", "grpo"], store, [0.5, 1.0], seeds=1)
    ppo_low, ppo_default, grpo_low, grpo_default = (p.cfg for p in points)
    tracking.setup(ppo_low)
    log_point(ppo_low, 400.0, 0.80, kl=6.0)  # the weaker penalty moves further
    log_point(ppo_default, 400.0, 0.70, kl=3.0)
    log_point(grpo_default, 500.0, 0.75, kl=9.0)  # grpo_low never finished
    found = align_compare.curves(points)
    assert [p.beta for p in found["ppo"]] == ["0.05", "0.025"]  # in order of KL
    assert found["ppo"][0].kl == (3.0, 2.5, 3.5) and found["ppo"][1].judge_win_rate == pytest.approx((0.8, 0.7, 0.9))
    assert [p.beta for p in found["grpo"]] == ["0.04"]
    fig = align_compare.plot(found)
    drawn = [container.lines[0] for container in fig.axes[0].containers]  # each errorbar call's data line
    assert [list(line.get_xdata()) for line in drawn] == [[3.0, 6.0], [9.0]]
    assert [list(line.get_ydata()) for line in drawn] == [[0.7, 0.8], [0.75]]
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["ppo", "grpo"]


def test_the_frontier_draws_each_algorithms_points_against_best_of_n(store):
    import numpy as np

    from rlhflow.evaluation.frontier import best_of_n_frontier

    points = align_compare.make_points(["ppo", "rloo"], store, [1.0], seeds=2)
    ppo0, ppo1, rloo0, _ = (p.cfg for p in points)
    tracking.setup(ppo0)

    def log_rewards(cfg, proxy: float, judge: float, kl: float) -> None:
        log_point(cfg, 400.0, 0.7, kl=kl)
        run = mlflow.search_runs(filter_string="attributes.run_name = 'pipeline'", output_format="list")[0]
        for name, value in {"eval/objective_mean": proxy, "eval/judge_reward_mean": judge}.items():
            mlflow.MlflowClient().log_metric(run.info.run_id, name, value)
            for end, shift in (("ci_low", -0.1), ("ci_high", 0.1)):
                mlflow.MlflowClient().log_metric(run.info.run_id, f"{name}_{end}", value + shift)

    log_rewards(ppo0, proxy=0.2, judge=0.4, kl=4.0)
    log_rewards(ppo1, proxy=0.4, judge=0.6, kl=2.0)
    log_rewards(rloo0, proxy=0.5, judge=0.3, kl=9.0)  # its second seed never finished
    rng = np.random.default_rng(0)
    baseline = best_of_n_frontier(rng.normal(size=(40, 4)), rng.normal(size=(40, 4)), [1, 4])
    markdown, fig = align_compare.frontier(points, baseline, missing_eos_penalty=1.0)
    rows = markdown.splitlines()[2:]
    assert [r.split(" | ")[:3] for r in rows] == [
        ["| best-of-n", "n=1", "0.00"],
        ["| best-of-n", "n=4", f"{np.log(4) - 3 / 4:.2f}"],
        ["| ppo", "beta=0.05 (2 seeds)", "3.00"],  # the seeds' mean KL
        ["| rloo", "beta=0.05", "9.00"],
    ]
    # two seeds: the mean optimised reward and its across-seed t interval, 0.3 +- 12.706 * 0.1414 / sqrt(2)
    assert "| 0.300 (-0.971 to 1.571) | 0.500 (-0.771 to 1.771) |" in rows[2]
    assert "| 0.500 (0.400 to 0.600) | 0.300 (0.200 to 0.400) |" in rows[3]  # one seed: its bootstrap interval
    judge_panel = fig.axes[1]
    assert [t.get_text() for t in judge_panel.get_legend().get_texts()] == ["best-of-n", "ppo", "rloo"]


def test_set_for_reaches_one_algorithm_and_the_paired_table_differences_seed_by_seed(store):
    points = align_compare.make_points(
        ["ppo", "rloo"], store, [1.0], seeds=3, own={"rloo": ["align.learning_rate=1e-5"]}
    )
    assert {p.cfg.align.learning_rate for p in points if p.algorithm == "rloo"} == {1e-5}
    assert {p.cfg.align.learning_rate for p in points if p.algorithm == "ppo"} == {load_config().align.learning_rate}
    ppo, rloo = points[:3], points[3:]
    tracking.setup(ppo[0].cfg)
    for p, win in zip(ppo, (0.6, 0.8, 0.7)):
        log_point(p.cfg, 400.0, win, kl=4.0 + p.seed)
    for p, win in zip(rloo[:2], (0.7, 0.8)):  # seed 2 never finished
        log_point(p.cfg, 500.0, win, kl=3.0)
    rows = {r.split(" | ")[0].strip("| "): r for r in align_compare.paired_table(points).splitlines()}
    assert rows["figure"] == "| figure | ppo 0.05 | rloo 0.05 | rloo 0.05 - ppo 0.05 |"
    # per seed, then the mean and its t interval; the difference over the seeds both have (0 and 1): 0.1 and 0.0
    assert rows["test: judge win rate"] == (
        "| test: judge win rate | 0.600, 0.800, 0.700; 0.700 (0.452 to 0.948) | 0.700, 0.800; 0.750 (0.115 to 1.385) "
        "| 0.050 (-0.585 to 0.685) |"
    )
    assert rows["test: KL to SFT, nats"].endswith("| -1.50 (-7.85 to 4.85) |")  # 3 - 4 and 3 - 5
    with pytest.raises(SystemExit):
        align_compare.main(["--algorithms", "ppo", "--set-for", "rloo:align.learning_rate=1e-5", "--table-only"])


def test_a_comparison_without_online_algorithms_draws_no_curves():
    # `--algorithms dpo` alone: no PPO, GRPO or RLOO point to draw (this used to fail on an empty list)
    assert align_compare.curves([]) == {}
