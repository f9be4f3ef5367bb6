"""Faults: an unreachable tracking server fails a preflight check in seconds; a stage killed while it writes
leaves either its previous complete output or none, and the next run cleans up and succeeds; a killed
reward-model training resumes from its last Trainer checkpoint."""

from __future__ import annotations

import hashlib
import json
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    REPO,
    kill_training_once,
    rerun_resumes,
    run_stage_cli,
    stage_command,
    stage_env,
    tiny_pipeline_overrides,
)


def closed_port() -> int:
    """A localhost port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def digest(path: Path) -> dict[str, str] | None:
    """md5 of each file under a dir by relative path (None when the dir does not exist)."""
    if not path.exists():
        return None
    return {
        str(p.relative_to(path)): hashlib.md5(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


# ---- the tracking server is down ------------------------------------------------------------------------


@pytest.mark.system
def test_unreachable_tracking_server_fails_the_flow_in_seconds(prefect_server, tmp_path, tiny_model_dir, monkeypatch):
    from flows.pipeline import rlhf_pipeline
    from rlhfops.tracking import TrackingUnavailableError

    # MLflow's own retry settings, left at values that would take minutes, must not delay the preflight
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "7")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "2")
    uri = f"http://127.0.0.1:{closed_port()}"
    overrides = tiny_pipeline_overrides(tmp_path, tiny_model_dir, tracking=False) + [f"tracking.tracking_uri={uri}"]
    start = time.perf_counter()
    with pytest.raises(TrackingUnavailableError, match=rf"MLflow tracking server {uri} is unreachable .*refused"):
        rlhf_pipeline(overrides=overrides)
    elapsed = time.perf_counter() - start
    assert elapsed < 15, f"preflight took {elapsed:.1f}s"
    assert list(tmp_path.iterdir()) == []  # no stage ran: not even the demo data was written


@pytest.mark.system
def test_unreachable_tracking_server_fails_a_stage_cli_before_it_starts(tmp_path, tiny_model_dir):
    uri = f"http://127.0.0.1:{closed_port()}"
    overrides = tiny_pipeline_overrides(tmp_path, tiny_model_dir, tracking=False) + [f"tracking.tracking_uri={uri}"]
    done = run_stage_cli("tasks.demo_data", overrides, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"demo_data failed: MLflow tracking server {uri} is unreachable" in done.stderr
    assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_unwritable_sqlite_store_fails_the_preflight(tmp_path):
    from rlhflow.config.params import load_config
    from rlhfops.tracking import TrackingUnavailableError, preflight

    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(TrackingUnavailableError, match="cannot write in"):
        preflight(load_config(None, [f"tracking.tracking_uri=sqlite:///{blocker}/mlflow.db"]))
    preflight(load_config(None, [f"tracking.tracking_uri=sqlite:///{tmp_path}/store/mlflow.db"]))  # creatable: fine
    assert (tmp_path / "store").is_dir()


def test_a_tracking_uri_naming_another_applications_database_is_refused_untouched(tmp_path):
    """A sqlite store is new or MLflow's: another application's database (or a file that is no database) fails the
    preflight naming the file, and gets no MLflow table."""
    import sqlite3

    from rlhflow.config.params import load_config
    from rlhfops.tracking import TrackingUnavailableError, preflight

    other = tmp_path / "app.db"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE users (name TEXT)")
    before = other.read_bytes()
    with pytest.raises(
        TrackingUnavailableError, match=r"app\.db is a sqlite database but not an MLflow tracking store"
    ):
        preflight(load_config(None, [f"tracking.tracking_uri=sqlite:///{other}"]))
    assert other.read_bytes() == before
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    with pytest.raises(TrackingUnavailableError, match=r"notes\.txt: not a sqlite database"):
        preflight(load_config(None, [f"tracking.tracking_uri=sqlite:///{notes}"]))
    assert notes.read_text() == "my notes\n"


@pytest.mark.parametrize("scheme", ["sqlite+pysqlite", "sqlite+aiosqlite", "SQLite"])
def test_a_sqlite_store_named_with_a_driver_or_in_capitals_is_checked_as_sqlite(scheme, tmp_path):
    """MLflow's database layer opens these as sqlite too: the preflight reads them as it does `sqlite:`."""
    import sqlite3

    from rlhflow.config.params import load_config
    from rlhfops.tracking import TrackingUnavailableError, preflight

    other = tmp_path / "app.db"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE users (name TEXT)")
    before = other.read_bytes()
    with pytest.raises(TrackingUnavailableError, match=r"app\.db is a sqlite database but not an MLflow"):
        preflight(load_config(None, [f"tracking.tracking_uri={scheme}:///{other}"]))
    assert other.read_bytes() == before


# ---- a stage killed mid-write ---------------------------------------------------------------------------


def preference_file(path: Path, n: int, variant: str) -> Path:
    text = " ".join(["Water it once a week, keep it in bright indirect light and feed it in spring."] * 6)
    rows = [
        {
            "prompt": f"[{variant}] How do I look after plant number {i}?",
            "chosen": f"{text} ({i})",
            "rejected": "Plants are boring.",
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.system
def test_validate_killed_while_writing_leaves_old_or_no_output_and_the_rerun_cleans_up(tmp_path, tiny_model_dir):
    from rlhflow.config.params import load_config
    from rlhfops.stage_runner import run_stage
    from tasks import validate

    out, report = tmp_path / "data/validated", tmp_path / "reports/validation"

    def overrides(data: Path, out_dir: Path = out, report_dir: Path = report) -> list[str]:
        return [
            f"data.preferences={data}",
            f"validate.out_dir={out_dir}",
            f"validate.report_dir={report_dir}",
            f"sft.model={tiny_model_dir}",
            f"metrics_dir={tmp_path / 'metrics'}",
            "tracking.log_models=false",
            f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        ]

    old_data, new_data = (
        preference_file(tmp_path / "a.jsonl", 200, "a"),
        preference_file(tmp_path / "b.jsonl", 4000, "b"),
    )
    run_stage("validate", validate.run, load_config(None, overrides(old_data)))  # the previous good output
    old = digest(out)
    # what a complete run on the new data writes (elsewhere)
    run_stage(
        "validate",
        validate.run,
        load_config(None, overrides(new_data, tmp_path / "ref/validated", tmp_path / "ref/validation")),
    )
    new = digest(tmp_path / "ref/validated")
    assert old and new and old != new

    rng = random.Random(int(time.time()))
    seen = []
    for attempt in range(2):
        proc = subprocess.Popen(
            stage_command("tasks.validate", overrides(new_data)),
            cwd=REPO,
            env=stage_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 240
        # the stage starts writing its outputs when its temporary output dir appears next to data/validated
        while not list(out.parent.glob(".validated.tmp-*")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        delay = rng.uniform(0, 0.25)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, f"the stage finished before it could be killed (attempt {attempt})"
        state = digest(out)
        assert state in (old, new), f"killed {delay:.3f}s into the write: a partial output {state}"
        seen.append("old" if state == old else "new")
        assert report.exists()  # the report dir too: old or new, never missing or partial
    leftovers = [p.name for p in out.parent.glob(".validated.*")] + [
        p.name for p in report.parent.glob(".validation.*")
    ]

    run_stage("validate", validate.run, load_config(None, overrides(new_data)))  # the rerun succeeds
    assert digest(out) == new
    assert not list(out.parent.glob(".validated.*")) and not list(report.parent.glob(".validation.*"))
    print("states after the kills:", seen, "temp paths the rerun removed:", leftovers)


# ---- reward-model training killed -----------------------------------------------------------------------

RM_ROWS, RM_BATCH, RM_CHECKPOINT_EVERY = 96, 2, 4


def test_a_checkpoint_whose_state_a_kill_cut_short_is_not_resumed_from(tmp_path):
    """A SIGKILL between creating trainer_state.json and finishing it leaves it empty or cut: that checkpoint is
    incomplete, and a rerun resumes from the one before."""
    from rlhflow.training.hf_trainer import last_complete_checkpoint

    for step, state in [(4, '{"global_step": 4}'), (8, ""), (12, '{"global_st')]:
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(state)
    assert last_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-4"


@pytest.mark.system
def test_killed_reward_model_training_resumes_from_its_last_checkpoint(tmp_path, tiny_model_dir):
    import mlflow
    import pandas as pd

    from rlhflow.data.readers import write_jsonl

    rows = [
        {
            "prompt": f"question {i}",
            "prompt_messages": [{"role": "user", "content": f"question {i}"}],
            "chosen": "Thank you for asking! Here are three clear steps.",
            "rejected": "no",
            "source_row": i + 1,
        }
        for i in range(RM_ROWS)
    ]
    write_jsonl(pd.DataFrame(rows), tmp_path / "validated/train.jsonl")
    write_jsonl(pd.DataFrame(rows[:8]), tmp_path / "validated/test.jsonl")
    overrides = [
        f"validate.out_dir={tmp_path / 'validated'}",
        f"reward_model.backbone={tiny_model_dir}",
        f"reward_model.out_dir={tmp_path / 'reward_model'}",
        f"reward_model.checkpoint_dir={tmp_path / 'ckpt'}",
        f"reward_model.batch_size={RM_BATCH}",
        f"reward_model.checkpoint_every={RM_CHECKPOINT_EVERY}",
        "reward_model.max_length=32",
        "reward_model.epochs=1",
        f"metrics_dir={tmp_path / 'metrics'}",
        "tracking.log_models=false",
        f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
    ]
    total_steps = RM_ROWS // RM_BATCH

    killed_at = kill_training_once("tasks.reward_model", overrides, tmp_path / "ckpt", RM_CHECKPOINT_EVERY)
    assert not (tmp_path / "reward_model").exists()
    assert RM_CHECKPOINT_EVERY <= killed_at < total_steps  # the kill may cut the second checkpoint mid-write

    rerun_resumes(
        "tasks.reward_model",
        overrides,
        what="reward model",
        killed_at=killed_at,
        out_dir=tmp_path / "reward_model",
        checkpoint_dir=tmp_path / "ckpt",
    )

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("rlhf").experiment_id])
    (finished,) = [r for r in runs if r.info.status == "FINISHED"]
    assert finished.data.metrics["rm/resumed_from_step"] == killed_at
    assert finished.data.metrics["rm/train_steps"] == total_steps  # the same length as an uninterrupted run
    logged_steps = [m.step for m in client.get_metric_history(finished.info.run_id, "rm/train_loss")]
    assert logged_steps and min(logged_steps) > killed_at  # it trained on from the checkpoint, not from step 0
