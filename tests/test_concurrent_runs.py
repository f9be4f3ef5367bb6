"""Runs side by side: two pipeline runs started together in one workspace never read or overwrite each other's
outputs (the second waits for the whole first run, rlhfops/workspace.py), and each MLflow parent run's evaluation
read the policy its own PPO stage wrote, as its recorded lineage shows; the two policies then meet head to head."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import PYTHON, REPO, stage_env, tiny_pipeline_overrides

from rlhflow.config.params import load_config


def _entry_md5(entry: dict, kind: str, path: str) -> str:
    return next(item["md5"] for item in entry[kind] if item["path"].rstrip("/") == path.rstrip("/"))


@pytest.mark.system
@pytest.mark.slow
def test_two_flow_runs_started_together_each_evaluate_their_own_policy(tmp_path, tiny_model_dir):
    import mlflow

    base = tiny_pipeline_overrides(tmp_path, tiny_model_dir)
    env = {**stage_env(), "PREFECT_HOME": str(tmp_path / "prefect")}  # a new home: both runs find no database

    def start(kl_coef: float) -> subprocess.Popen:
        args = [a for o in [*base, f"ppo.kl_coef={kl_coef}"] for a in ("--set", o)]
        return subprocess.Popen(
            [PYTHON, "-m", "flows.pipeline", *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    first = start(0.01)
    time.sleep(1.0)
    second = start(0.5)
    outputs = [p.communicate(timeout=900)[0] for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    waited = [o for o in outputs if "waiting for pipeline" in o]
    assert len(waited) == 1, "exactly one run waits for the other"

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("rlhf").experiment_id
    parents = [r for r in client.search_runs([experiment]) if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 2 and all(r.info.status == "FINISHED" for r in parents)
    policy = f"{tmp_path}/models/policy"
    policies = {}
    for parent in parents:
        dst = tmp_path / "lineage" / parent.info.run_id
        dst.mkdir(parents=True)
        lock = yaml.safe_load(Path(client.download_artifacts(parent.info.run_id, "dvc.lock", str(dst))).read_text())
        stages = lock["stages"]
        written = _entry_md5(stages["ppo"], "outs", policy)
        assert _entry_md5(stages["evaluate"], "deps", policy) == written, "evaluated another run's policy"
        kl_coef = float(parent.data.params["ppo.kl_coef"])
        assert stages["ppo"]["params"]["params.yaml"]["ppo"]["kl_coef"] == kl_coef
        policies[kl_coef] = written
        # nothing lost: the run's own evaluation figures are on its parent run
        assert "eval/judge_win_rate_vs_sft" in parent.data.metrics and "eval/kl" in parent.data.metrics
    assert set(policies) == {0.01, 0.5} and policies[0.01] != policies[0.5]
    versions = client.search_model_versions("name = 'rlhf-policy'")
    assert len(versions) == 2  # each run registered its own policy
    check_head_to_head(client, experiment, base, {float(p.data.params["ppo.kl_coef"]): p.info.run_id for p in parents})


def check_head_to_head(client, experiment: str, overrides: list[str], runs: dict[float, str]) -> None:
    """The two runs' policies head to head on the test prompts (tasks/head_to_head.py, `python -m flows.compare`):
    A's win rates with intervals, logged as a run both link to; refused for a run that is no pipeline run or for
    policies measured by another judge."""
    from tasks import head_to_head

    cfg, (a, b) = load_config(overrides=overrides), (runs[0.01], runs[0.5])
    figures = head_to_head.compare_runs(cfg, a, b)
    rate = figures["compare/judge_win_rate_a_over_b"]
    assert 0 <= figures["compare/judge_win_rate_ci_low"] <= rate <= figures["compare/judge_win_rate_ci_high"] <= 1
    assert figures["compare/prompts"] > 0 and "compare/judge_win_rate_lc" in figures, figures
    (compared,) = client.search_runs([experiment], "tags.compare = 'rlhf'")
    assert (compared.data.params["run_a"], compared.data.params["run_b"]) == (a, b)
    assert compared.data.metrics["compare/judge_win_rate_a_over_b"] == rate
    assert "A's win rate over B" in compared.data.tags["mlflow.note.content"]
    assert client.get_run(a).data.tags[f"compare.with.{b}"] == compared.info.run_id
    assert client.get_run(b).data.tags[f"compare.with.{a}"] == compared.info.run_id
    with pytest.raises(head_to_head.ComparisonError, match="is not a finished pipeline run"):
        head_to_head.compare_runs(cfg, a, compared.info.run_id)
    version = head_to_head.policy_version(client, b)
    client.set_model_version_tag("rlhf-policy", version, "basis.judge_md5", "another judge")
    with pytest.raises(head_to_head.ComparisonError, match="measured on different judge_md5"):
        head_to_head.compare_runs(cfg, a, b)


FLOW = """
from prefect import flow
from rlhfops.temporary_server import start_temporary_server

@flow
def one():
    return 1

start_temporary_server()
print("result", one())
"""


@pytest.mark.system
def test_runs_started_together_on_a_new_prefect_home_all_complete(tmp_path):
    """The first temporary server of a Prefect home creates its database; started together, three runs would each
    migrate it and two would fail ("database is locked"). They start their servers one at a time."""
    env = {**stage_env(), "PREFECT_HOME": str(tmp_path / "prefect")}
    cmd = [sys.executable, "-c", FLOW]
    runs = [
        subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in runs]
    assert [p.returncode for p in runs] == [0, 0, 0], "\n".join(o[-2000:] for o in outputs)
    assert all("result 1" in o for o in outputs)


SETUP_WHEN_GO = """
import sys, time
from pathlib import Path
import mlflow
from rlhflow.config.params import load_config
from rlhfops import tracking
go = Path(sys.argv[2])
Path(sys.argv[3]).touch()  # imported, waiting
while not go.exists():
    time.sleep(0.005)
tracking.setup(load_config(overrides=[f"tracking.tracking_uri={sys.argv[1]}"]))
"""


@pytest.mark.system
def test_runs_started_together_on_a_new_sqlite_store_all_set_it_up(tmp_path):
    """Three processes set up tracking at the same moment on a store no run has made yet: MLflow creates its tables
    on first use, and all three must go on (not "table ... already exists")."""
    uri, go = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SETUP_WHEN_GO, uri, str(go), str(tmp_path / f"ready-{i}")],
            cwd=REPO,
            env=stage_env(),
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(3)
    ]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready-*"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    go.touch()
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [e[-2000:] for e in errors]
