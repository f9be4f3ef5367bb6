"""The pipeline machinery around the ML library (rlhflow): the stage list that drives the Prefect flow and
dvc.yaml (stages, codedeps), whether a stage is up to date and its record (stage_lock), what a run leaves in
MLflow and DVC (run_record) and putting it back (restore), MLflow tracking, the model registry and champion
promotion (tracking, registry, promotion), the pyfunc wrappers that serve registered models (serving), content
hashes (hashing), one run per workspace (workspace) and the harness every stage module runs in (stage_runner).

It imports the ML library; the ML library never imports it.
"""

import importlib.util
import sys

# What every stage, flow and command of the project imports. dvc.yaml's commands run the `python` of the PATH: with
# `.venv/bin/dvc repro` and no activated venv that is another interpreter, and a stage must say so in one line.
STACK = ("torch", "transformers", "mlflow", "prefect", "dvc")
_missing = [name for name in STACK if importlib.util.find_spec(name) is None]
if _missing:
    raise SystemExit(
        f"{sys.executable} has no {', '.join(_missing)}: run the project's commands with its venv's Python "
        "(`source .venv/bin/activate` first, or put .venv/bin first on PATH; `make setup` creates the venv)"
    )
