"""bench/align_compare.py on a real MLflow store: the table takes each point's newest finished pipeline run and its
ppo stage's wall time, and DPO's equal-time steps come from PPO's stage time and DPO's seconds per step."""

from __future__ import annotations

import mlflow
import pytest

from bench import align_compare
from rlhflow.config import load_config
from rlhfops import tracking


@pytest.fixture
def points(tmp_path):
    base = [f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db"]
    return [
        (f"align.algorithm={a}", load_config(overrides=[*base, f"align.algorithm={a}"])) for a in ("ppo", "grpo", "dpo")
    ]


def log_point(cfg, stage_seconds: float, judge_win_rate: float, status: str = "FINISHED") -> None:
    with tracking.pipeline_run(cfg) as parent:
        mlflow.log_metrics(
            {
                "eval/kl": 2.5,
                "eval/judge_win_rate_vs_sft": judge_win_rate,
                "eval/judge_win_rate_ci_low": judge_win_rate - 0.1,
                "eval/judge_win_rate_ci_high": judge_win_rate + 0.1,
            }
        )
        with tracking.stage_run(cfg, "ppo", ["align"], parent_run_id=parent.info.run_id):
            mlflow.log_metric("time/ppo_s", stage_seconds)
        if status != "FINISHED":
            mlflow.end_run(status=status)


def test_the_table_reads_each_points_newest_finished_run(points):
    ppo, grpo, dpo = (cfg for _, cfg in points)
    tracking.setup(ppo)
    log_point(ppo, 400.0, 0.60)
    log_point(ppo, 420.0, 0.85)  # newer: this one counts
    log_point(grpo, 500.0, 0.75, status="FAILED")  # not finished: no row
    log_point(dpo, 1000.0, 0.58)
    rows = align_compare.table(points).splitlines()[2:]
    assert rows[0].startswith("| ppo | align.algorithm=ppo | 160 | 420 | 0.850 (0.750-0.950) |")
    assert "no finished run" in rows[1]
    assert rows[2].startswith("| dpo | align.algorithm=dpo | 0 | 1000 | 0.580 (0.480-0.680) |")
    # DPO ran 20 steps in 1000 s: PPO's 420 s buy 8 of them
    assert align_compare.dpo_equal_time_steps(points) == round(420 / (1000 / dpo.align.steps))


def test_equal_time_needs_both_runs(points):
    tracking.setup(points[0][1])
    log_point(points[0][1], 420.0, 0.85)
    assert align_compare.dpo_equal_time_steps(points) is None
