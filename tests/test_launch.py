"""Data-parallel stages started by the flow and by hand in `launch.<stage>` processes (rlhfops/launch.py): on tiny
models in a git+DVC repo, reward_model and ppo each in 2 gloo processes under `accelerate launch`, recorded in the
same lineage as any stage."""

from __future__ import annotations

import sys

import mlflow
import pytest
import yaml
from conftest import make_dvc_repo

from rlhflow.config.params import load_config, write_params
from rlhfops import launch

pytestmark = [pytest.mark.slow, pytest.mark.system]

TWO = ["launch.reward_model=2", "launch.ppo=2", "launch.accelerate_config=configs/accelerate/cpu_2proc.yaml"]


def test_the_command_follows_the_launch_section(monkeypatch):
    one = launch.command("ppo", load_config(), ["--set", "seed=1"])
    assert one == [sys.executable, "-m", "tasks.ppo", "--set", "seed=1"]
    assert launch.command("evaluate", load_config(overrides=["launch.ppo=4"]), []) == [
        sys.executable,
        "-m",
        "tasks.evaluate",
    ]  # not data parallel: always one process
    two = launch.command("ppo", load_config(overrides=TWO), ["--set", "seed=1"])
    assert two[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert two[two.index("--num_processes") + 1] == "2" and two[-4:] == ["-m", "tasks.ppo", "--set", "seed=1"]
    assert two[two.index("--config_file") + 1].endswith("configs/accelerate/cpu_2proc.yaml")
    monkeypatch.setenv("RLHFLOW_ALLOW_CODE", "launch.accelerate_config")  # a file of the user's own, allowed
    with pytest.raises(FileNotFoundError, match="launch.accelerate_config"):
        launch.command("ppo", load_config(overrides=["launch.ppo=2", "launch.accelerate_config=nowhere.yaml"]), [])


def test_flow_runs_two_process_stages_records_them_and_a_rerun_skips(tmp_path, tiny_model_dir):
    repo = tmp_path / "repo"
    run = make_dvc_repo(repo, tiny_model_dir, timeout=900)
    write_params(load_config(repo / "params.yaml", TWO), repo / "params.yaml")
    assert run("git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "two").returncode == 0

    first = run(sys.executable, "-m", "flows.pipeline", "--stages", "demo_data,validate,sft,reward_model,ppo")
    out = first.stdout + first.stderr
    assert first.returncode == 0, out[-4000:]

    # one MLflow child run per stage, under the flow's parent run, with the process count among its params
    client = mlflow.MlflowClient(f"sqlite:///{repo}/mlflow.db")
    experiment = client.get_experiment_by_name("rlhf")
    (parent,) = client.search_runs(
        [experiment.experiment_id], "attributes.run_name = 'stages: demo_data,validate,sft,reward_model,ppo'"
    )
    for stage in ("reward_model", "ppo"):
        runs = client.search_runs([experiment.experiment_id], f"tags.stage = '{stage}'")
        assert len(runs) == 1, stage  # rank 1 opened no run of its own
        assert runs[0].data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert runs[0].info.status == "FINISHED" and runs[0].data.params[f"launch.{stage}"] == "2"

    # dvc.lock: the entries `dvc repro` would write, with the launcher's command and the process count
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    assert lock["ppo"]["cmd"] == "python -m rlhfops.launch ppo"
    assert lock["ppo"]["params"]["params.yaml"]["launch.ppo"] == 2
    assert lock["reward_model"]["params"]["params.yaml"]["launch.reward_model"] == 2
    status = run("dvc", "status", "ppo")
    assert status.returncode == 0 and "up to date" in status.stdout, status.stdout + status.stderr

    again = run(sys.executable, "-m", "flows.pipeline", "--stages", "reward_model,ppo")
    out = again.stdout + again.stderr
    assert again.returncode == 0 and "reward_model: skipped" in out and "ppo: skipped" in out, out[-3000:]

    # by hand, as dvc.yaml runs it: two processes again, and the lock entry recorded for the next run
    (repo / "metrics/ppo.json").unlink()
    stale = run("dvc", "status", "ppo")
    assert "deleted" in stale.stdout, stale.stdout + stale.stderr
    by_hand = run(sys.executable, "-m", "rlhfops.launch", "ppo")
    out = by_hand.stdout + by_hand.stderr
    assert by_hand.returncode == 0 and "ppo: 2 processes" in out and "ppo: recorded (dvc.lock)" in out, out[-3000:]
    status = run("dvc", "status", "ppo")
    assert "up to date" in status.stdout, status.stdout + status.stderr
    assert len(client.search_runs([experiment.experiment_id], "tags.stage = 'ppo'")) == 2
