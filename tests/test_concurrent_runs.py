"""Runs side by side: two pipeline runs started together in one workspace never read or overwrite each other's
outputs (the second waits for the whole first run, rlhfops/workspace.py), and each MLflow parent run's evaluation
read the policy its own PPO stage wrote, as its recorded lineage shows."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, stage_env, tiny_pipeline_overrides


def _entry_md5(entry: dict, kind: str, path: str) -> str:
    return next(item["md5"] for item in entry[kind] if item["path"].rstrip("/") == path.rstrip("/"))


@pytest.mark.system
@pytest.mark.slow
def test_two_flow_runs_started_together_each_evaluate_their_own_policy(tmp_path, tiny_model_dir):
    import mlflow

    base = tiny_pipeline_overrides(tmp_path, tiny_model_dir)

    def start(kl_coef: float) -> subprocess.Popen:
        args = [a for o in [*base, f"ppo.kl_coef={kl_coef}"] for a in ("--set", o)]
        return subprocess.Popen(
            [sys.executable, "-m", "flows.pipeline", *args],
            cwd=REPO,
            env=stage_env(),
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
