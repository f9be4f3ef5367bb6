"""The whole chain on tiny models: the Prefect flow with MLflow tracking, and `dvc repro` in a real git repo.

These run every stage for real (Great Expectations suite, RewardTrainer, the PPO engine, evaluation) on a
tiny Llama with seconds per stage."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, tiny_pipeline_overrides
from rlhflow.stages import STAGES
from rlhflow.tracking import file_md5

EVAL_METRICS = ["eval/reward_mean", "eval/reward_mean_sft", "eval/win_rate_vs_sft", "eval/kl", "eval/perplexity",
                "eval/perplexity_sft", "rm/accuracy"]


@pytest.fixture(scope="module")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


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

    # datasets are run inputs whose digest is the DVC md5 of the validated files
    digests = {d.dataset.name: d.dataset.digest for d in children["validate"].inputs.dataset_inputs}
    assert digests["preferences-train"] == file_md5(tmp_path / "data/validated/train.jsonl")
    assert digests["preferences-test"] == file_md5(tmp_path / "data/validated/test.jsonl")

    # models registered from the successful run, alias `candidate`
    for name, stage in [("rlhf-reward-model", "reward_model"), ("rlhf-policy", "ppo")]:
        version = client.get_model_version_by_alias(name, "candidate")
        assert version.run_id == children[stage].info.run_id

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
    assert {r.data.tags.get("stage", "pipeline") for r in runs} == {"pipeline", "validate"}
    assert all(r.info.status == "FAILED" for r in runs)
    assert client.search_registered_models() == []
    assert not (tmp_path / "data/validated").exists()


def _copy_repo(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        if (REPO / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dst / rel)


def test_dvc_repro_runs_the_stages_then_nothing(tmp_path, tiny_model_dir):
    from rlhflow.config import load_config, write_params

    repo = tmp_path / "repo"
    repo.mkdir()
    _copy_repo(repo)
    cfg = load_config(repo / "params.yaml", tiny_pipeline_overrides(".", tiny_model_dir, tracking=False))
    write_params(cfg, repo / "params.yaml")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(repo)}
    env.pop("MLFLOW_TRACKING_URI", None)  # mlflow.set_tracking_uri in earlier tests exports it
    run = lambda *cmd: subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=900)  # noqa: E731
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "-c", "user.name=t", "-c", "user.email=t@t",
                                                                "commit", "-qm", "init"]):
        assert run(*cmd).returncode == 0

    first = run("dvc", "repro")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    for s in STAGES:
        assert f"Running stage '{s.name}'" in first.stdout
    second = run("dvc", "repro")
    assert second.returncode == 0 and "Running stage" not in second.stdout, second.stdout

    shown = run("dvc", "metrics", "show", "--json")
    assert shown.returncode == 0, shown.stderr
    metrics = json.loads(shown.stdout)
    files = next(iter(metrics.values()))["data"]
    for s in STAGES:
        for m in s.metrics:
            assert any(path.endswith(m.split("/")[-1]) for path in files), f"{m} missing from dvc metrics show"
    assert yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["ppo"]["outs"]
    # the stages logged to the default store at the repo root, whatever the cwd
    assert (repo / "mlflow.db").exists()
