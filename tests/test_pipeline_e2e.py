"""The whole chain on tiny models: the Prefect flow with MLflow tracking (`dvc repro` in a real git repo: see
test_evaluate.py, which shares one repro among its DVC tests).

These run every stage for real (Great Expectations suite, RewardTrainer, the PPO engine, evaluation) on a
tiny Llama with seconds per stage."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_pipeline_overrides

from rlhfops.hashing import file_md5
from rlhfops.stages import STAGES

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


def test_flow_runs_every_stage_and_tracks_them(prefect_server, tmp_path, tiny_model_dir):
    import mlflow

    from flows.pipeline import rlhf_pipeline

    results = rlhf_pipeline(overrides=tiny_pipeline_overrides(tmp_path, tiny_model_dir))
    for key in EVAL_METRICS:
        assert key in results

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("rlhf")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1
    parent = parents[0]
    children = {r.data.tags["stage"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert set(children) == {s.name for s in STAGES}
    assert all(r.info.status == "FINISHED" for r in runs)
    for key in EVAL_METRICS:  # evaluation metrics on the parent run too
        assert parent.data.metrics[key] == pytest.approx(results[key])
    assert parent.data.params["ppo.kl_coef"] == "0.05"
    assert children["ppo"].data.params["ppo.steps"] == "2"
    assert "ppo/kl" in children["ppo"].data.metrics and "ppo/score_mean" in children["ppo"].data.metrics
    assert len(client.get_metric_history(children["ppo"].info.run_id, "ppo/kl")) == 2
    # the SFT model's perplexity on the same rows: measured once, by the sft stage, and taken by evaluate
    assert children["evaluate"].data.metrics["eval/perplexity_sft"] == children["sft"].data.metrics["sft/perplexity"]

    # datasets are run inputs whose digest is the DVC md5 of the validated files
    digests = {d.dataset.name: d.dataset.digest for d in children["validate"].inputs.dataset_inputs}
    assert digests["preferences-train"] == file_md5(tmp_path / "data/validated/train.jsonl")
    assert digests["preferences-test"] == file_md5(tmp_path / "data/validated/test.jsonl")

    # models registered from the successful run, alias `candidate`
    for name, stage in [("rlhf-reward-model", "reward_model"), ("rlhf-policy", "ppo")]:
        version = client.get_model_version_by_alias(name, "candidate")
        assert version.run_id == children[stage].info.run_id

    # the parent run lists its stages' datasets, logged models and registered versions
    assert {"preferences-train", "preferences-test"} <= {d.dataset.name for d in parent.inputs.dataset_inputs}
    stage_models = {m.model_id for c in children.values() for m in c.outputs.model_outputs}
    assert stage_models and {m.model_id for m in parent.outputs.model_outputs} == stage_models
    registered = parent.data.tags["registered_models"].split(", ")
    assert {"rlhf-reward-model/1", "rlhf-policy/1"} <= set(registered)

    # stage outputs and metrics files on disk
    for s in STAGES:
        if s.metrics:
            assert (tmp_path / "metrics" / f"{s.name}.json").exists()
    assert json.loads((tmp_path / "metrics/evaluate.json").read_text())["eval/kl"] == pytest.approx(results["eval/kl"])
    assert (tmp_path / "models/policy/model.safetensors").exists()
    assert (tmp_path / "reports/validation/validation.html").exists()
    assert (tmp_path / "metrics/ppo_history.csv").read_text().startswith("step,")


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
