"""The tracking URI: a relative sqlite path, as users write it, names a store under the repository root."""

from __future__ import annotations

import pytest

from rlhflow import tracking
from rlhflow.config import load_config


@pytest.fixture
def repo_root(tmp_path, monkeypatch):
    """A stand-in repository root; the tests run from another directory, so nothing may resolve against the cwd."""
    import mlflow

    root, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    monkeypatch.setattr(tracking, "project_root", lambda: root)
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # mlflow.set_tracking_uri exports it
    before = mlflow.get_tracking_uri()
    yield root
    mlflow.set_tracking_uri(before)


def test_a_dvc_experiment_copy_belongs_to_the_repository_around_it(tmp_path):
    from rlhflow.config import project_root

    assert project_root(tmp_path / "proj" / ".dvc" / "tmp" / "exps" / "tmpa1b2c3") == tmp_path / "proj"
    assert project_root(tmp_path / "proj") == tmp_path / "proj"


def test_relative_sqlite_uris_resolve_against_the_repository_root(repo_root):
    assert tracking.absolute_sqlite_uri("sqlite:///./mlflow.db") == f"sqlite:///{repo_root}/mlflow.db"
    assert tracking.absolute_sqlite_uri("sqlite:///runs/../mlflow.db") == f"sqlite:///{repo_root}/mlflow.db"
    assert tracking.absolute_sqlite_uri("sqlite:///runs/m.db?timeout=5") == f"sqlite:///{repo_root}/runs/m.db?timeout=5"
    for unchanged in ("sqlite:////abs/mlflow.db", "sqlite:///:memory:", "http://host:5000", "databricks"):
        assert tracking.absolute_sqlite_uri(unchanged) == unchanged
    assert tracking.tracking_uri(load_config()) == f"sqlite:///{repo_root}/mlflow.db"  # the default, the same way


def test_a_relative_sqlite_store_records_runs_and_artifacts_under_the_repository_root(repo_root):
    """`--set tracking.tracking_uri=sqlite:///./mlflow.db`: the preflight, the experiment's artifact root (a file URI,
    which a relative path cannot be) and the runs all use <repo>/mlflow.db and <repo>/mlartifacts."""
    cfg = load_config(overrides=["tracking.tracking_uri=sqlite:///./mlflow.db"])
    assert tracking.sqlite_artifact_root(cfg.tracking.tracking_uri) == repo_root / "mlartifacts"
    tracking.preflight(cfg)
    mlflow = tracking.setup(cfg)
    with mlflow.start_run() as run:
        mlflow.log_metric("m", 1.0)
        mlflow.log_text("hello", "note.txt")
    assert (repo_root / "mlflow.db").is_file()
    client = mlflow.MlflowClient(f"sqlite:///{repo_root}/mlflow.db")
    assert client.get_run(run.info.run_id).data.metrics == {"m": 1.0}
    (note,) = (repo_root / "mlartifacts").rglob("note.txt")
    assert note.read_text() == "hello"
    assert not list((repo_root.parent / "elsewhere").iterdir())  # nothing relative to the cwd
