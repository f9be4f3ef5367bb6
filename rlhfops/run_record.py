"""What a pipeline run leaves behind: on its MLflow parent run, the lock entries of its stages (artifact
`dvc.lock`), the resolved params (`params.yaml`) and the small uncached outputs (metrics, plot data) under
`outputs/`, which is what rlhfops/restore.py puts back; a run with overrides is also saved as a DVC experiment
(`save_experiment`), so `dvc exp show` lists its params and metrics.
"""

from __future__ import annotations

# dvc is heavy: it is imported inside the function that reads its experiment refs.
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import mlflow
import yaml

from rlhflow.config.params import REPO_ROOT, Config, load_config, write_params
from rlhfops import tracking
from rlhfops.stage_lock import (
    LOCK_FILE,
    PARAMS_FILE,
    dvc_records,
    dvc_repo,
    git,
    lock_entry,
    repo_lock,
    uncached_outputs,
)
from rlhfops.stages import STAGES, get_stage
from rlhfops.tracking import redact  # URL passwords and secret environment values never reach MLflow


def log_run_lineage(cfg: Config, names: list[str]) -> dict[str, Any]:
    """On the active (parent) MLflow run: artifact `dvc.lock` (the lock entries of the run's stages),
    `params.yaml` (the fully resolved params) and `outputs/<path>` (the uncached outputs). A run with overrides
    that DVC recorded is also saved as a DVC experiment (tag `dvc.experiment`). Returns the lock."""

    run = mlflow.active_run()
    if names and has_overrides(cfg) and all(dvc_records(get_stage(n), cfg) for n in names):
        try:
            with dvc_repo() as repo, repo_lock(repo):  # dvc.lock as the last stage left it
                ref = save_experiment(
                    cfg, f"flow-{run.info.run_id[:10]}", f"pipeline run {run.info.run_id}: {', '.join(names)}"
                )
        except (OSError, subprocess.SubprocessError) as err:  # a nicety: the run is recorded and restorable anyway
            stderr = getattr(err, "stderr", b"") or b""
            print(f"could not save the run as a DVC experiment: {err} {stderr.decode(errors='replace')[-500:]}")
            ref = None
        if ref:
            mlflow.set_tag(EXP_TAG, ref.rsplit("/", 1)[-1])

    lock: dict[str, Any] = {"schema": "2.0", "stages": {}}
    for name in names:
        stage = get_stage(name)
        entry = lock_entry(stage, cfg)
        if entry:
            lock["stages"][name] = entry
        for template in uncached_outputs(stage):
            rel = stage.resolve(cfg, template)
            if cfg.path(rel).is_file():
                mlflow.log_artifact(str(cfg.path(rel)), artifact_path=artifact_dir(rel))
    tracking.link_stage_runs(run.info.run_id)  # the stages' datasets and models, listed on the parent run
    mlflow.log_text(redact(yaml.safe_dump(lock, sort_keys=False)), LOCK_FILE)
    mlflow.log_text(redact(yaml.safe_dump(cfg.to_params(), sort_keys=False)), PARAMS_FILE)
    return lock


def artifact_dir(path: str) -> str:
    """Where a run keeps its copy of the uncached output `path`: outputs/<its directory>."""
    parent = Path(os.path.normpath(path)).parent.as_posix().lstrip("/")
    return "outputs" if parent in ("", ".") else f"outputs/{parent}"


# ---- runs with overrides as DVC experiments (`dvc exp show`) -----------------------------------------------------

EXP_TAG = "dvc.experiment"


def has_overrides(cfg: Config) -> bool:
    """The run's config differs from the repository's params.yaml (--set, the Prefect form, --params)."""

    return cfg.to_params() != load_config().to_params()


def save_experiment(cfg: Config, name: str, message: str) -> str | None:
    """Record the run as a DVC experiment on the current commit, as `dvc exp save` would, without touching the
    workspace: a commit (parent HEAD) of the tracked files as they are in the workspace, with params.yaml holding
    the run's resolved params and the run's dvc.lock, metrics and plot data, under `refs/exps/...`. Returns the
    ref, or None where there is no git commit to hang it on."""

    from dvc.repo.experiments.refs import ExpRefInfo

    try:
        head = git("rev-parse", "--verify", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        return None
    ident = {
        "GIT_AUTHOR_NAME": "rlhflow flow",
        "GIT_AUTHOR_EMAIL": "flow@rlhflow",
        "GIT_COMMITTER_NAME": "rlhflow flow",
        "GIT_COMMITTER_EMAIL": "flow@rlhflow",
    }
    files: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        write_params(cfg, Path(tmp) / PARAMS_FILE)
        files[PARAMS_FILE] = redact((Path(tmp) / PARAMS_FILE).read_text()).encode()
    if (REPO_ROOT / LOCK_FILE).is_file():
        files[LOCK_FILE] = (REPO_ROOT / LOCK_FILE).read_bytes()
    for stage in STAGES:
        for template in uncached_outputs(stage):
            path = cfg.path(stage.resolve(cfg, template))
            try:
                rel = path.resolve().relative_to(REPO_ROOT).as_posix()
            except ValueError:
                continue  # outside the repository: not part of a commit
            if path.is_file():
                files[rel] = path.read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**ident, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git("read-tree", "HEAD", env=env)
        git("add", "--update", env=env)  # tracked files as they are in the workspace (the code that ran)
        for rel, data in files.items():
            blob = git("hash-object", "-w", "--stdin", stdin=data)
            git("update-index", "--add", "--cacheinfo", f"100644,{blob},{rel}", env=env)
        tree = git("write-tree", env=env)
        commit = git("commit-tree", tree, "-p", head, "-m", message, env=env)
    ref = str(ExpRefInfo(baseline_sha=head, name=name))
    git("update-ref", ref, commit)
    return ref
