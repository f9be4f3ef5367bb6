"""Up-to-date stages are skipped by the flow, as `dvc repro` skips them: same hashes (DVC's own), same deps,
params sections and outputs (rlhfops/stages.py, from which dvc.yaml is generated)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import make_dvc_repo, tiny_pipeline_overrides

from rlhflow.config.params import load_config
from rlhfops import stage_lock
from rlhfops.hashing import dvc_md5s
from rlhfops.stages import get_stage


def _config(root: Path, *extra: str):
    return load_config(
        overrides=[
            f"metrics_dir={root}/metrics",
            f"data.preferences={root}/prefs.jsonl",
            f"validate.out_dir={root}/validated",
            f"validate.report_dir={root}/report",
            f"sft.out_dir={root}/sft",
            f"sft.train_data={root}/validated/train.jsonl",  # a dep of sft: here too, not the workspace's
            *extra,
        ]
    )


def _write_validate_outputs(root: Path) -> None:
    (root / "validated").mkdir(parents=True, exist_ok=True)
    (root / "validated/train.jsonl").write_text('{"prompt": "a"}\n')
    (root / "validated/test.jsonl").write_text('{"prompt": "b"}\n')
    (root / "report").mkdir(exist_ok=True)
    (root / "report/validation.json").write_text("{}")
    (root / "metrics").mkdir(exist_ok=True)
    (root / "metrics/validate.json").write_text('{"validate/train_rows": 1.0}')


def test_recorded_stage_is_up_to_date_until_a_param_dep_or_output_changes(tmp_path):
    validate = get_stage("validate")
    (tmp_path / "prefs.jsonl").write_text('{"prompt": "a", "chosen": "x", "rejected": "y"}\n')
    cfg = _config(tmp_path)
    assert stage_lock.why_stale(validate, cfg) != []  # never ran: it runs
    _write_validate_outputs(tmp_path)
    stage_lock.record_run(validate, cfg)
    assert stage_lock.why_stale(validate, cfg) == []

    # a param of one of its sections
    reasons = stage_lock.why_stale(validate, _config(tmp_path, "validate.test_fraction=0.3"))
    assert reasons == ["params validate changed"]
    # a param of a section it does not read changes nothing
    assert stage_lock.why_stale(validate, _config(tmp_path, "ppo.kl_coef=0.3")) == []

    # a dep file's content (not its time)
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text(prefs.read_text())
    assert stage_lock.why_stale(validate, cfg) == []
    prefs.write_text(prefs.read_text() + '{"prompt": "b", "chosen": "x", "rejected": "y"}\n')
    assert stage_lock.why_stale(validate, cfg) == [f"dep {prefs} changed"]
    stage_lock.record_run(validate, cfg)
    assert stage_lock.why_stale(validate, cfg) == []

    # an output edited or deleted by hand
    (tmp_path / "validated/test.jsonl").write_text('{"prompt": "c"}\n')
    assert stage_lock.why_stale(validate, cfg) == [f"output {tmp_path}/validated changed"]
    shutil.rmtree(tmp_path / "validated")
    assert f"output {tmp_path}/validated is missing" in stage_lock.why_stale(validate, cfg)


def test_new_upstream_output_makes_the_downstream_stage_stale(tmp_path):
    sft = get_stage("sft")
    cfg = _config(tmp_path)
    _write_validate_outputs(tmp_path)
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft/model.safetensors").write_bytes(b"weights")
    (tmp_path / "metrics/sft.json").write_text("{}")
    stage_lock.record_run(sft, cfg)
    assert stage_lock.why_stale(sft, cfg) == []
    (tmp_path / "validated/train.jsonl").write_text('{"prompt": "new"}\n')  # validate ran again, new split
    assert stage_lock.why_stale(sft, cfg) == [
        f"dep {tmp_path}/validated changed",
        f"dep {tmp_path}/validated/train.jsonl changed",  # sft.train_data, a file of the new split
    ]


@pytest.mark.system
def test_hashes_are_dvcs_own(tmp_path):
    """The md5 the flow records for a directory is the one `dvc add` writes."""
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text("a\n")
    (data / "sub/b.bin").write_bytes(bytes(range(256)))
    dvc = Path(sys.executable).parent / "dvc"
    for cmd in ([dvc, "init", "--no-scm", "-q"], [dvc, "add", "-q", "data"]):
        subprocess.run(cmd, cwd=tmp_path, check=True, capture_output=True, timeout=120)
    dvc_md5 = yaml.safe_load((tmp_path / "data.dvc").read_text())["outs"][0]["md5"]
    with dvc_md5s(tmp_path / "metrics") as md5:
        assert md5(data) == dvc_md5


def _stage_runs(db: Path) -> list[str]:
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name("rlhf").experiment_id], order_by=["start_time ASC"])
    return [r.data.tags["stage"] for r in runs if "stage" in r.data.tags]


@pytest.mark.system
def test_second_flow_run_skips_and_a_changed_param_reruns_that_stage(prefect_server, tmp_path, tiny_model_dir):
    from flows.pipeline import rlhf_pipeline

    overrides = tiny_pipeline_overrides(tmp_path, tiny_model_dir)
    stages = ["demo_data", "validate"]
    first = rlhf_pipeline(overrides=overrides, stages=stages)
    assert _stage_runs(tmp_path / "mlflow.db") == stages
    assert "time/validate_s" in first

    second = rlhf_pipeline(overrides=overrides, stages=stages)
    assert _stage_runs(tmp_path / "mlflow.db") == stages  # no new stage run: both skipped
    assert "time/validate_s" not in second
    assert second["validate/train_rows"] == first["validate/train_rows"]  # the recorded metrics are reported

    # validate reads `validate`: it reruns; demo_data does not read it: still skipped
    third = rlhf_pipeline(overrides=[*overrides, "validate.test_fraction=0.5"], stages=stages)
    assert _stage_runs(tmp_path / "mlflow.db") == [*stages, "validate"]
    assert third["validate/test_rows"] > first["validate/test_rows"]

    # a new demo file (a dep of validate) reruns both: demo_data's param, then validate's dep
    rlhf_pipeline(overrides=[*overrides, "validate.test_fraction=0.5", "data.demo.n_prompts=40"], stages=stages)
    assert _stage_runs(tmp_path / "mlflow.db") == [*stages, "validate", *stages]

    # force runs everything
    rlhf_pipeline(
        overrides=[*overrides, "validate.test_fraction=0.5", "data.demo.n_prompts=40"], stages=stages, force=True
    )
    assert _stage_runs(tmp_path / "mlflow.db") == [*stages, "validate", *stages, *stages]
    assert json.loads((tmp_path / "metrics/validate.json").read_text())["validate/test_rows"] > 0


@pytest.mark.system
def test_flow_skips_what_dvc_repro_just_ran(tmp_path, tiny_model_dir):
    """`dvc repro` records its stages in dvc.lock; the flow, in the same repository, finds them up to date."""
    run = make_dvc_repo(tmp_path / "repo", tiny_model_dir, timeout=600)
    repo = tmp_path / "repo"
    repro = run("dvc", "repro", "validate")
    assert repro.returncode == 0 and "Running stage 'validate'" in repro.stdout, repro.stdout + repro.stderr

    flow = run(sys.executable, "-m", "flows.pipeline", "--stages", "demo_data,validate")
    out = flow.stdout + flow.stderr
    assert flow.returncode == 0, out[-3000:]
    assert "demo_data: skipped" in out and "validate: skipped" in out, out[-3000:]
    assert not (repo / "metrics/.flow/flow.lock").exists()  # dvc.lock alone vouched for them
