"""The whole chain on tiny models: a flow that bad data stops (the flow run that succeeds, with its MLflow runs, is
test_mlflow_ui.py's, which checks it and then shows it in the MLflow UI; `dvc repro` in a real git repo: see
test_evaluate.py, which shares one repro among its DVC tests).

These run every stage for real (Great Expectations suite, RewardTrainer, the PPO engine, evaluation) on a
tiny Llama with seconds per stage."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_pipeline_overrides

pytestmark = pytest.mark.system  # whole flow runs on a Prefect test server

EVAL_METRICS = [
    "eval/reward_mean",
    "eval/reward_mean_sft",
    "eval/win_rate_vs_sft",
    "eval/kl",
    "eval/perplexity",
    "eval/perplexity_sft",
    "rm/accuracy",
]


def test_bad_data_stops_the_flow_and_registers_nothing(prefect_server, tmp_path, tiny_model_dir):
    import mlflow

    from flows.pipeline import rlhf_pipeline

    bad = tmp_path / "bad.jsonl"
    rows = [{"prompt": f"question {i}?", "chosen": "same answer", "rejected": "same answer"} for i in range(10)]
    bad.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    overrides = tiny_pipeline_overrides(tmp_path, tiny_model_dir) + [f"data.preferences={bad}"]
    with pytest.raises(Exception, match="row"):
        rlhf_pipeline(overrides=overrides)
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("rlhf").experiment_id])
    status = {r.data.tags.get("stage", "pipeline"): r.info.status for r in runs}
    # demo_data is a stage of dvc.yaml like any other, so it runs (and succeeds) before validate
    assert status == {"pipeline": "FAILED", "demo_data": "FINISHED", "validate": "FAILED"}
    assert client.search_registered_models() == []
    assert not (tmp_path / "data/validated").exists()
