"""The pipeline from a source tree without `.git` (a release archive, the Docker image): DVC runs without git, the
flow records and skips stages as in a clone and says once that there is no git; an error a retry cannot fix fails
at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PYTHON, copy_project, tiny_pipeline_overrides, with_prefect_api


def _export(dest: Path, model_dir: Path) -> dict[str, str]:
    """The project's files as `git archive` would hold them (tracked, with their working-tree content), no .git;
    params.yaml set to the tiny pipeline. Returns the environment to run commands there."""
    from rlhflow.config.params import load_config, write_params

    copy_project(dest, untracked=False)
    write_params(
        load_config(dest / "params.yaml", tiny_pipeline_overrides(".", model_dir, tracking=False)), dest / "params.yaml"
    )
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(dest)}
    env.pop("MLFLOW_TRACKING_URI", None)
    env["GIT_CEILING_DIRECTORIES"] = str(dest.parent)  # no git repository above the export either
    return with_prefect_api(env)


@pytest.mark.system
def test_the_pipeline_runs_and_skips_without_git(tmp_path, tiny_model_dir):
    export = tmp_path / "export"
    env = _export(export, tiny_model_dir)
    assert not (export / ".git").exists() and (export / ".dvc").is_dir()

    def flow() -> str:
        done = subprocess.run(
            [PYTHON, "-m", "flows.pipeline", "--stages", "demo_data,validate"],
            cwd=export,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        out = done.stdout + done.stderr
        assert done.returncode == 0, out[-4000:]
        assert "Retrying" not in out and "SCMError" not in out, out[-4000:]
        return out

    first = flow()
    assert first.count("is not a git repository: DVC runs without git") == 1, first[-4000:]
    assert "demo_data: running" in first and "validate: running" in first
    assert (export / "data/validated/dev.jsonl").is_file()
    second = flow()
    assert "demo_data: skipped" in second and "validate: skipped" in second, second[-4000:]


def test_errors_a_retry_cannot_fix_are_not_retried():
    from flows.pipeline import is_transient

    assert is_transient(ConnectionRefusedError()) and is_transient(TimeoutError())
    assert not is_transient(FileNotFoundError("params.yaml")) and not is_transient(ValueError("bad"))

    class SCMError(Exception):  # dvc.scm.SCMError: not a git repository
        pass

    class OperationalError(Exception):  # sqlite3 / SQLAlchemy: database is locked
        pass

    assert not is_transient(SCMError("/x is not a git repository")) and is_transient(OperationalError("locked"))
