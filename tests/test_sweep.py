"""The sweep flow on tiny models (flows/sweep.py): each point a pipeline run nested under the sweep's MLflow run,
upstream stages shared, a failed point reported while the others go on, a rerun that skips finished points, and the
frontier against best-of-n on disk and in MLflow."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from conftest import tiny_pipeline_overrides


@pytest.mark.system
@pytest.mark.slow
def test_a_sweep_runs_its_points_and_draws_the_frontier(
    prefect_server, one_thread, tmp_path, tiny_model_dir, allow_test_reward
):
    import mlflow

    from flows.sweep import parse_grid, rlhf_sweep

    overrides = tiny_pipeline_overrides(tmp_path, tiny_model_dir)
    # the third point fails at run time (a reward function that does not exist); the others go on
    grid = parse_grid(["ppo.kl_coef=0.01,0.5", "ppo.reward_fn=null,tests.no_such_module:score"])
    assert len(grid["ppo.reward_fn"]) == 2
    outcomes = rlhf_sweep(grid=grid, overrides=overrides, best_of_n=[1, 2, 4])
    status = {o["point"]: o["status"] for o in outcomes}
    assert len(status) == 4
    assert [s for p, s in status.items() if "null" in p] == ["finished", "finished"], status
    assert all(s.startswith("failed") for p, s in status.items() if "no_such_module" in p), status

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("rlhf").experiment_id
    sweep = client.search_runs([experiment], "tags.sweep = 'rlhf'")[0]
    points = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{sweep.info.run_id}'")
    finished = [r for r in points if r.info.status == "FINISHED" and r.info.run_name == "pipeline"]
    assert len(finished) == 2 and {r.data.params["ppo.kl_coef"] for r in finished} == {"0.01", "0.5"}
    assert set(sweep.data.tags["sweep.points"].split(",")) >= {r.info.run_id for r in finished}
    # before best-of-n, the upstream stages were brought to the first point's settings (here up to date)
    upstream = [r for r in points if r.info.run_name.startswith("stages: ")]
    assert [r.info.run_name for r in upstream] == ["stages: demo_data,validate,sft,reward_model,judge"]
    assert upstream[0].info.status == "FINISHED"
    # the second point shares the first one's upstream stages: they were up to date, not recomputed
    second = max(finished, key=lambda r: r.info.start_time)
    assert {"validate", "sft", "reward_model", "judge"} <= set(second.data.tags["skipped_stages"].split(","))
    assert {a.path for a in client.list_artifacts(sweep.info.run_id, "frontier")} >= {
        "frontier/frontier.png",
        "frontier/frontier.md",
        "frontier/sweep_frontier.csv",
    }

    frontier = pd.read_csv(tmp_path / "metrics/sweep_frontier.csv")
    bon = frontier[frontier["method"] == "best-of-n"]
    assert list(bon["point"]) == ["n=1", "n=2", "n=4"] and bon["kl"].iloc[0] == 0
    assert len(frontier[frontier["method"] == "ppo"]) == 2
    assert (frontier["proxy_reward_ci_low"] <= frontier["proxy_reward"]).all()

    # a rerun skips the finished points (and reuses the best-of-n samples); the failed one is tried again
    cache = tmp_path / "metrics/.flow/best_of_n.json"
    sampled_at = cache.stat().st_mtime_ns
    again = rlhf_sweep(grid=grid, overrides=overrides, best_of_n=[1, 2, 4])
    assert sorted(o["status"] for o in again)[-2:] == ["reused", "reused"]
    assert cache.stat().st_mtime_ns == sampled_at  # the samples were not drawn again
    assert (
        len(client.search_runs([experiment], "attributes.run_name = 'pipeline' and attributes.status = 'FINISHED'"))
        == 2
    )


def test_the_best_point_is_chosen_on_the_dev_split_and_seeds_are_aggregated():
    from flows.sweep import PointOutcome, best_point, seed_groups, seed_metrics, seed_table

    def outcome(kl_coef: str, seed: int, test: float, dev: float) -> PointOutcome:
        metrics = {"eval/judge_win_rate_both_ended": test, "dev/judge_win_rate_both_ended": dev, "eval/kl": 1.0}
        return PointOutcome([f"ppo.kl_coef={kl_coef}"], "finished", f"run-{kl_coef}-{seed}", metrics, seed=seed)

    # the test split favours 0.1, the dev split 0.2: the choice follows dev
    outcomes = [outcome("0.1", s, test=0.9, dev=0.5 + 0.01 * s) for s in range(3)]
    outcomes += [outcome("0.2", s, test=0.5, dev=0.6 + 0.01 * s) for s in range(3)]
    outcomes.append(PointOutcome(["ppo.kl_coef=0.2"], "failed: boom", seed=3))
    groups = seed_groups(outcomes)
    assert [g.label for g in groups] == ["ppo.kl_coef=0.1", "ppo.kl_coef=0.2"]
    assert best_point(groups).label == "ppo.kl_coef=0.2"
    mean, low, high = groups[1].figure("dev/judge_win_rate_both_ended")
    assert mean == pytest.approx(0.61) and low == pytest.approx(0.61 - 4.303 * 0.01 / 3**0.5, abs=1e-3)
    table = seed_table(groups)
    assert "| ppo.kl_coef=0.2 | 3/4 |" in table and "0.610 (0.585 to 0.635)" in table
    metrics = seed_metrics(groups)
    assert metrics["point/ppo.kl_coef_0.2/dev_judge_win_rate_both_ended_mean"] == pytest.approx(0.61)
    assert "point/ppo.kl_coef_0.1/eval_kl_ci_low" in metrics


@pytest.mark.system
def test_sweep_help_lists_every_option_and_params_key():
    import subprocess
    import sys

    shown = subprocess.run([sys.executable, "-m", "flows.sweep", "--help"], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    for text in ("--grid", "--seeds", "--best-of-n", "--set", "ppo.kl_coef = ", "validate.dev_fraction = "):
        assert text in shown.stdout, text
    missing = subprocess.run([sys.executable, "-m", "flows.sweep"], capture_output=True, text=True)
    assert missing.returncode == 2 and "at least one --grid" in missing.stderr


@pytest.mark.system
@pytest.mark.slow
def test_a_sweep_with_seeds_groups_them(prefect_server, one_thread, tmp_path, tiny_model_dir):
    import mlflow

    from flows.sweep import rlhf_sweep

    overrides = tiny_pipeline_overrides(tmp_path, tiny_model_dir)
    outcomes = rlhf_sweep(grid={"ppo.kl_coef": ["0.05"]}, overrides=overrides, best_of_n=[], seeds=2)
    assert [(o["seed"], o["status"]) for o in outcomes] == [(0, "finished"), (1, "finished")]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("rlhf").experiment_id
    sweep = client.search_runs([experiment], "tags.sweep = 'rlhf'")[0]
    points = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{sweep.info.run_id}'")
    assert {r.data.tags["sweep.point"] for r in points} == {"ppo.kl_coef=0.05"}
    assert sorted(r.data.tags["sweep.seed"] for r in points) == ["0", "1"]
    assert sorted(r.data.params["seed"] for r in points) == ["0", "1"]
    assert sweep.data.params["seeds"] == "2" and sweep.data.tags["sweep.best_point"] == "ppo.kl_coef=0.05"
    assert "point/ppo.kl_coef_0.05/eval_kl_mean" in sweep.data.metrics
    report = Path(client.download_artifacts(sweep.info.run_id, "frontier/frontier.md", str(tmp_path))).read_text()
    assert "ppo.kl_coef=0.05 (2 seeds)" in report and "| ppo.kl_coef=0.05 | 2/2 |" in report
    assert "chosen on the dev split" in report
