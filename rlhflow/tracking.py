"""MLflow tracking: one parent run per pipeline run, one child run per stage (tag `stage=<name>`).

The tracking URI is `tracking.tracking_uri` from params, else $MLFLOW_TRACKING_URI, else a sqlite store at
the repository root (never relative to the cwd, so DVC stages and flows write to the same store).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlhflow.config import REPO_ROOT, Config
from rlhflow.fsutil import write_json_atomic

def tracking_uri(cfg: Config) -> str:
    return cfg.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{REPO_ROOT / 'mlflow.db'}"


def setup(cfg: Config):
    import mlflow

    uri = tracking_uri(cfg)
    mlflow.set_tracking_uri(uri)
    if uri.startswith("sqlite:") and mlflow.get_experiment_by_name(cfg.tracking.experiment) is None:
        # Artifacts next to the sqlite store, not relative to whatever the cwd happens to be.
        db_path = Path(uri.removeprefix("sqlite:///"))
        mlflow.create_experiment(cfg.tracking.experiment, artifact_location=(db_path.parent / "mlartifacts").as_uri())
    mlflow.set_experiment(cfg.tracking.experiment)
    return mlflow


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def file_md5(path: str | os.PathLike) -> str:
    """The md5 DVC 3 records for a file output (plain md5 of the bytes)."""
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def start_run(cfg: Config, *, name: str, params: dict[str, Any], tags: dict[str, str],
              parent_run_id: str | None = None) -> Iterator[Any]:
    """A run that is marked FAILED (and re-raises) when the body raises, FINISHED otherwise."""
    mlflow = setup(cfg)
    commit = git_commit()
    tags = {**tags, **({"git_commit": commit} if commit else {})}
    run = mlflow.start_run(run_name=name, parent_run_id=parent_run_id, nested=parent_run_id is not None, tags=tags)
    try:
        if params:
            mlflow.log_params({k: "null" if v is None else v for k, v in flatten(params).items()})
        yield run
    except BaseException as err:
        mlflow.set_tag("error", f"{type(err).__name__}: {err}"[:5000])
        mlflow.end_run(status="FAILED")
        raise
    else:
        mlflow.end_run(status="FINISHED")


def pipeline_run(cfg: Config, *, run_name: str = "pipeline"):
    return start_run(cfg, name=run_name, params=cfg.to_params(), tags={"pipeline": "rlhf"})


def stage_run(cfg: Config, stage: str, sections: list[str], parent_run_id: str | None = None):
    params = {s: cfg.section(s) for s in sections}
    return start_run(cfg, name=stage, params=params, tags={"stage": stage}, parent_run_id=parent_run_id)


def log_metrics(metrics: dict[str, float], *, run_ids: list[str | None] = (), step: int | None = None) -> None:
    """Log to the active run and to any other given runs (the evaluate stage also logs on the parent)."""
    import mlflow

    clean = {k: float(v) for k, v in metrics.items() if v is not None}
    mlflow.log_metrics(clean, step=step)
    client = mlflow.MlflowClient()
    for run_id in run_ids:
        if run_id:
            for key, value in clean.items():
                client.log_metric(run_id, key, value, step=step or 0)


def log_dataset(path: str | os.PathLike, *, name: str, context: str) -> str:
    """Log a JSONL/Parquet dataset as a run input whose digest is its DVC md5."""
    import mlflow
    import pandas as pd

    path = Path(path)
    digest = file_md5(path)
    df = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_json(path, lines=True)
    df = df[[c for c in df.columns if df[c].map(lambda v: isinstance(v, (str, int, float))).all()]]
    dataset = mlflow.data.from_pandas(df, source=str(path), name=name, digest=digest)
    mlflow.log_input(dataset, context=context)
    return digest


def write_stage_metrics(cfg: Config, stage: str, metrics: dict[str, float]) -> Path:
    """metrics/<stage>.json: what `dvc metrics show` lists; the same numbers MLflow has."""
    path = cfg.path(cfg.metrics_dir) / f"{stage}.json"
    write_json_atomic(path, {k: float(v) for k, v in metrics.items()})
    return path


MODEL_PIP_REQUIREMENTS = ["torch", "transformers", "safetensors", "accelerate", "pandas"]


def log_model_dir(cfg: Config, model_dir: str | os.PathLike, *, name: str, kind: str,
                  registered_name: str | None = None, alias: str = "candidate") -> str | None:
    """Log a saved model dir as an MLflow pyfunc model (`kind`: "policy" or "reward") when
    `tracking.log_models` is on; register it (when `tracking.register_models` is on) and point `alias` at the
    new version. Call this only once the stage has succeeded: a failed run registers nothing."""
    import mlflow

    if not cfg.tracking.log_models:
        return None
    if not cfg.tracking.register_models:
        registered_name = None

    from rlhflow.serving import PolicyPyfunc, RewardPyfunc

    python_model = {"policy": PolicyPyfunc, "reward": RewardPyfunc}[kind]()
    info = mlflow.pyfunc.log_model(
        name=name, python_model=python_model, artifacts={"model_dir": str(model_dir)},
        pip_requirements=MODEL_PIP_REQUIREMENTS, registered_model_name=registered_name,
        code_paths=[str(REPO_ROOT / "rlhflow")],  # the wrappers' own code travels with the model
    )
    if registered_name and info.registered_model_version is not None:
        mlflow.MlflowClient().set_registered_model_alias(registered_name, alias, str(info.registered_model_version))
        mlflow.set_tag(f"registered/{registered_name}", str(info.registered_model_version))
        return str(info.registered_model_version)
    return None
