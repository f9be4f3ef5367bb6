"""The sweep flow on tiny models (flows/sweep.py): each point a pipeline run nested under the sweep's MLflow run,
upstream stages shared, a failed point reported while the others go on, a rerun that skips finished points, and the
frontier against best-of-n on disk and in MLflow."""

from __future__ import annotations

import pandas as pd
import pytest
from conftest import tiny_pipeline_overrides


@pytest.mark.system
@pytest.mark.slow
def test_a_sweep_runs_its_points_and_draws_the_frontier(prefect_server, one_thread, tmp_path, tiny_model_dir):
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
    finished = [r for r in points if r.info.status == "FINISHED"]
    assert len(finished) == 2 and {r.data.params["ppo.kl_coef"] for r in finished} == {"0.01", "0.5"}
    assert set(sweep.data.tags["sweep.points"].split(",")) >= {r.info.run_id for r in finished}
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
