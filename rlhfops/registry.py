"""The MLflow model registry: the names the stages register under, logging a saved model dir as a pyfunc model
(with its signature and input example) and registering it, and finding a registered version again.

Every registered version gets alias `candidate`; alias `champion` moves by the rule in
rlhflow/evaluation/champion.py, applied by rlhfops/promotion.py.
"""

from __future__ import annotations

# mlflow is imported inside the functions that use it
import os
import tempfile
from pathlib import Path

import mlflow
import yaml
from mlflow.exceptions import MlflowException

from rlhflow.config.params import REPO_ROOT, Config
from rlhfops import tracking
from rlhfops.hashing import dir_md5

# one place for the names: stages and evaluation share them without importing each other
SFT = "rlhf-sft"
REWARD_MODEL = "rlhf-reward-model"
JUDGE = "rlhf-judge"
POLICY = "rlhf-policy"

CANDIDATE = "candidate"
CHAMPION = "champion"
CONTENT_TAG = "content_md5"
MODEL_PIP_REQUIREMENTS = ["torch", "transformers", "safetensors", "accelerate", "pandas"]


def log_model_dir(
    cfg: Config,
    model_dir: str | os.PathLike,
    *,
    name: str,
    wrapper: type,
    registered_name: str | None = None,
    alias: str = CANDIDATE,
) -> str | None:
    """Log a saved model dir as an MLflow pyfunc model, an instance of `wrapper` (a `mlflow.pyfunc.PythonModel`
    subclass: rlhfops.serving.policy.PolicyPyfunc or rlhfops.serving.reward.RewardPyfunc) logged as code, when
    `tracking.log_models` is on; register it (when `tracking.register_models` is on) and point `alias` at the
    new version. Call this only once the stage has succeeded: a failed run registers nothing."""

    if not cfg.tracking.log_models:
        return None
    if not cfg.tracking.register_models:
        registered_name = None

    with tempfile.TemporaryDirectory() as code_dir:
        info = mlflow.pyfunc.log_model(
            name=name,
            python_model=str(model_code(wrapper, Path(code_dir))),
            signature=wrapper.SIGNATURE,
            input_example=wrapper.INPUT_EXAMPLE,
            artifacts={"model_dir": str(model_dir)},
            pip_requirements=MODEL_PIP_REQUIREMENTS,
            registered_model_name=registered_name,
            # the wrappers' own code (rlhfops/serving) and the library they run travel with the model
            code_paths=[str(REPO_ROOT / "rlhflow"), str(REPO_ROOT / "rlhfops")],
        )
    if registered_name and info.registered_model_version is not None:
        client = tracking.client()
        client.set_registered_model_alias(registered_name, alias, str(info.registered_model_version))
        # lets a later stage (evaluate, even under `dvc repro` in another process) find the version of a model dir
        client.set_model_version_tag(
            registered_name, str(info.registered_model_version), CONTENT_TAG, dir_md5(model_dir)
        )
        mlflow.set_tag(f"registered/{registered_name}", str(info.registered_model_version))
        return str(info.registered_model_version)
    return None


def model_code(wrapper: type, code_dir: Path) -> Path:
    """The model as code (MLflow's models-from-code): a file that builds the wrapper from the logged rlhfops. A
    pickled instance would need the same cloudpickle to load, and MLflow warns about unpickling code."""
    path = code_dir / f"{wrapper.__module__.rpartition('.')[2]}_model.py"
    path.write_text(
        f"import mlflow.models\n\nfrom {wrapper.__module__} import {wrapper.__qualname__}\n\n"
        f"mlflow.models.set_model({wrapper.__qualname__}())\n"
    )
    return path


def version_by_alias(client, name: str, alias: str):
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None  # no such model or alias yet


def version_of_model_dir(client, name: str, model_dir: str | os.PathLike):
    """The registered version logged from a model dir with these exact contents (newest first), or None."""
    found = client.search_model_versions(
        f"name = '{name}' and tags.{CONTENT_TAG} = '{dir_md5(model_dir)}'",
        order_by=["version_number DESC"],
        max_results=1,
    )
    return found[0] if found else None


def registered_model_dir(client, name: str, version: str, dst: str | os.PathLike) -> Path:
    """Download a registered pyfunc model (logged by `log_model_dir`) and return its plain model dir."""

    client.model_version_location(name, version)  # where the store keeps its files passes the rule first
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version}", dst_path=str(dst)))
    flavor = yaml.safe_load((local / "MLmodel").read_text())["flavors"]["python_function"]
    return local / flavor["artifacts"]["model_dir"]["path"]
