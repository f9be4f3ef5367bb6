"""MLflow tracking: one parent run per pipeline run, one child run per stage (tag `stage=<name>`).

The tracking URI is `tracking.tracking_uri` from params, else $MLFLOW_TRACKING_URI, else a sqlite store at
the repository root. A relative sqlite path is taken from the repository root too (never from the cwd, so DVC
stages and flows write to the same store). The URI's credentials (user info, a key in its query) and secret
environment values never reach what is printed, logged or stored (`redact`).
"""

from __future__ import annotations

# Models are logged and registered by rlhfops/registry.py, champions moved by rlhfops/promotion.py.
import contextlib
import copy
import fcntl
import functools
import hashlib
import json
import math
import os
import re
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from mlflow.data.dataset_source_registry import get_registered_sources
from mlflow.entities import Metric
from mlflow.utils.credentials import get_default_host_creds
from mlflow.utils.rest_utils import http_request
from mlflow.utils.uri import extract_db_type_from_uri
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from rlhflow.config import credentials
from rlhflow.config.params import REPO_ROOT, Config, project_root
from rlhflow.fsutil import write_json_atomic
from rlhflow.redaction import REDACTED, redact_url, redact_urls, user_info_removed
from rlhfops import store_replies, store_transport
from rlhfops.hashing import file_md5

# a tracking server's every reply read within bounds of size and time (rlhfops/store_replies.py)
store_replies.bound_mlflow_replies()


def tracking_uri(cfg: Config) -> str:
    """The store this run logs to. A configured URI without user info that $MLFLOW_TRACKING_URI names with user info
    is taken from the environment: a team run's stage parameters carry the store without credentials
    (flows/team.py), and each worker adds the ones its own environment holds."""
    configured, environment = cfg.tracking.tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
    if configured and environment and configured != environment and user_info_removed(environment) == configured:
        configured = environment
    return absolute_sqlite_uri(configured or environment or "sqlite:///mlflow.db")


def stored_config(cfg: Config) -> Config:
    """`cfg` as a Prefect flow run's parameters or a deployment's form may hold it (Prefect stores and shows both):
    the tracking URI without its user info, which moves to this process's $MLFLOW_TRACKING_URI instead, where
    tracking_uri() finds it for that store (the flow's stages and served runs inherit the environment)."""
    uri = cfg.tracking.tracking_uri
    if not uri or user_info_removed(uri) == uri:
        return cfg
    os.environ["MLFLOW_TRACKING_URI"] = uri
    return cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"tracking_uri": user_info_removed(uri)})})


def is_sqlite_uri(uri: str) -> bool:
    """Whether MLflow opens `uri` as a sqlite database: its database layer (SQLAlchemy) reads `sqlite:`, with any
    driver (`sqlite+pysqlite:`, `sqlite+aiosqlite:`) and in any case."""
    try:
        return make_url(uri).get_backend_name().lower() == "sqlite"
    except (ArgumentError, ValueError):
        return False


def absolute_sqlite_uri(uri: str) -> str:
    """A sqlite URI whose path is relative (`sqlite:///mlflow.db`, `sqlite:///./runs/mlflow.db`, as users write it) with
    that path taken from the project's root, not the cwd: every stage and flow then opens the same store, and its
    artifact root can be a file URI. In a DVC experiment's temporary copy of the repository (`dvc exp run --temp`,
    queued experiments) that is the repository around the copy (config.project_root), so the runs outlive the
    copy. Other URIs come back unchanged."""
    if ":///" not in uri or not is_sqlite_uri(uri):
        return uri
    scheme, rest = uri.split(":///", 1)
    path, query_sep, query = rest.partition("?")
    if path in ("", ":memory:") or Path(path).is_absolute():
        return uri
    return f"{scheme}:///{os.path.normpath(project_root() / path)}{query_sep}{query}"


def sqlite_artifact_root(uri: str) -> Path:
    """Where runs of a sqlite store keep their artifacts: next to the db file, not relative to the cwd
    (`make ui`'s MLflow server serves the same directory)."""
    return sqlite_path(uri).parent / "mlartifacts"


def sqlite_path(uri: str) -> Path:
    """The database file of a sqlite tracking URI, resolved against the repository root."""
    return Path(absolute_sqlite_uri(uri).split(":///", 1)[1].partition("?")[0])


def setup(cfg: Config):
    uri = tracking_uri(cfg)
    check_transport(uri)  # before MLflow sends anything, whichever command got here
    mlflow.set_tracking_uri(uri)
    if redact_url(uri) != uri:  # MLflow prints run links with the URI's credentials; the flows print theirs without
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    if is_sqlite_uri(uri):
        _create_sqlite_store_once(uri)
    name = cfg.tracking.experiment
    # Several runs start at once (CLI, Prefect UI, workers): whichever creates the experiment or writes one of its
    # tags first wins, and the others find it done instead of failing on the store's unique constraint.
    for attempt in range(3):
        try:
            if is_sqlite_uri(uri) and mlflow.get_experiment_by_name(name) is None:
                mlflow.create_experiment(name, artifact_location=sqlite_artifact_root(uri).as_uri())
            experiment = mlflow.set_experiment(name)
            missing = {k: v for k, v in EXPERIMENT_TAGS.items() if experiment.tags.get(k) is None}
            for key, value in missing.items():  # a description the user wrote in the UI is kept
                mlflow.set_experiment_tag(key, value)
            return mlflow
        except mlflow.exceptions.MlflowException:
            experiment = mlflow.get_experiment_by_name(name)
            if attempt == 2 or experiment is None:
                raise
            time.sleep(0.2 * (attempt + 1))  # another run is writing the same experiment: read it again


def _create_sqlite_store_once(uri: str) -> None:
    """Make the sqlite store's tables under a file lock: MLflow creates them on first use, and two runs started
    at once on a new store would otherwise both create them ("table ... already exists")."""

    path = sqlite_path(uri)
    if str(path) in ("", ":memory:") or path.is_file() and path.stat().st_size > 0:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".create-lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        client(uri).search_experiments(max_results=1)


# What MLflow's UI shows for the experiment: its kind, and a description (the experiment page's note).
EXPERIMENT_TAGS = {
    "mlflow.experimentKind": "custom_model_development",
    "mlflow.note.content": (
        "RLHF pipeline runs (rlhflow): one parent run per pipeline run, one child run per stage (tag `stage`). "
        "A parent run carries the git commit (`mlflow.source.git.commit`), the resolved params (params and the "
        "`params.yaml` artifact) and its stages' DVC lock entries (artifact `dvc.lock`): "
        "`python -m flows.restore RUN_ID` puts its data, models and metrics back."
    ),
}
GIT_COMMIT_TAG = "mlflow.source.git.commit"
RUN_DESCRIPTION_TAG = "mlflow.note.content"  # a run's description in MLflow's UI (Markdown)


# ---- preflight: fail in seconds, before any stage runs, when the tracking store cannot be used -----------

PREFLIGHT_TIMEOUT_S = 5.0


class TrackingUnavailableError(RuntimeError):
    """The MLflow tracking store cannot be reached or written; raised by `preflight` before any work."""


def preflight(cfg: Config, timeout: float = PREFLIGHT_TIMEOUT_S) -> None:
    """Check the tracking store before any stage runs: an http(s) server must answer one MLflow API call
    within `timeout` seconds (one try: MLflow's own retries would take minutes to give up), a sqlite or
    file store must sit in a writable directory. Other stores (postgresql, databricks, ...) are not checked."""
    uri = tracking_uri(cfg)
    check_transport(uri)
    scheme = "sqlite" if is_sqlite_uri(uri) else uri.split(":", 1)[0].lower() if "://" in uri else "file"
    if scheme in ("http", "https"):
        _check_server(uri, timeout)
    elif scheme in ("sqlite", "file"):
        if scheme == "sqlite":
            path = Path(uri.split(":///", 1)[1]) if ":///" in uri else None
            where = path.parent if path is not None and str(path) not in ("", ":memory:") else None
        else:
            where = Path(uri.removeprefix("file://") if uri.startswith("file:") else uri)
        if where is not None:
            _check_writable_dir(where, uri)
        if scheme == "sqlite" and where is not None:
            _check_mlflow_database(sqlite_path(uri))


# tables every MLflow sqlite store has (its schema migrations and its experiments)
MLFLOW_TABLES = {"alembic_version", "experiments"}


def _check_mlflow_database(path: Path) -> None:
    """A sqlite tracking store is new (no file, or an empty one) or MLflow's: a tracking URI that names another
    application's database would get MLflow's tables added to it. Read only; refused naming the file."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    try:
        with contextlib.closing(sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)) as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as err:
        raise TrackingUnavailableError(f"{path}: not a sqlite database ({err}); nothing was run") from None
    if not MLFLOW_TABLES <= tables:
        raise TrackingUnavailableError(
            f"{path} is a sqlite database but not an MLflow tracking store (no {', '.join(sorted(MLFLOW_TABLES))} "
            "table): the tracking URI must name a new file or an MLflow store, never another application's "
            "database; nothing was run"
        )


# MLflow's switch for its client following a tracking server's redirects (on by default)
ALLOW_REDIRECTS = "MLFLOW_ALLOW_HTTP_REDIRECTS"


def check_transport(uri: str) -> None:
    """The rule of rlhfops/store_transport.py on what the store's client sends by itself: a URI that clients read
    differently is refused, and so are plain http and an unencrypted database connection to another host, whatever
    credentials are or are not found. Sends nothing; raises TrackingUnavailableError. MLflow's client is told to
    follow no redirect: a tracking server answers its API itself, and a redirect would take the run's data (its
    credentials too, were requests' rule of dropping them elsewhere ever relaxed) to wherever it points. A user whose
    proxy needs one sets the variable."""
    scheme = credentials.scheme_and_host(uri)[0]  # as MLflow reads the scheme: spaces stripped
    if scheme in ("http", "https"):
        os.environ.setdefault(ALLOW_REDIRECTS, "false")
        problem = store_transport.http_store_problem(uri)
    elif "://" in uri and not is_sqlite_uri(uri) and _is_database_uri(uri):
        problem = store_transport.database_store_problem(uri)
    else:
        problem = None
    if problem:
        raise TrackingUnavailableError(f"{problem}. Nothing was run.")


def client(uri: str | None = None) -> CheckedClient:
    """The project's one way to an MLflow client (tests/test_security.py holds every other module to it): the
    store's transport checked before anything is sent, and every run's artifact location before a file goes there
    or comes from there. `uri`: the store setup() chose when None."""
    uri = uri or mlflow.get_tracking_uri()
    check_transport(uri)
    return CheckedClient(uri)


class CheckedClient(mlflow.MlflowClient):
    """MLflow's client, whose artifact transfers first check the location the store names for the run."""

    def _checked_run(self, run_id: str) -> None:
        check_artifact_location(self.get_run(run_id).info.artifact_uri, self._tracking_client.tracking_uri)

    def log_artifact(self, run_id, local_path, artifact_path=None):
        self._checked_run(run_id)
        return super().log_artifact(run_id, local_path, artifact_path)

    def log_artifacts(self, run_id, local_dir, artifact_path=None):
        self._checked_run(run_id)
        return super().log_artifacts(run_id, local_dir, artifact_path)

    def download_artifacts(self, run_id, path, dst_path=None):
        self._checked_run(run_id)
        return super().download_artifacts(run_id, path, dst_path)

    def model_version_location(self, name: str, version: str) -> str:
        """Where a registered model version's files are, checked."""
        location = self.get_model_version_download_uri(name, version)
        return check_artifact_location(location, self._tracking_client.tracking_uri)


def _is_database_uri(uri: str) -> bool:
    """Whether MLflow opens `uri` through SQLAlchemy (postgresql, mysql, mssql and their drivers)."""
    try:
        extract_db_type_from_uri(uri)
        return True
    except Exception:  # MLflow's own test: not one of its database schemes
        return False


def check_artifact_location(location: str, tracking: str | None = None) -> str:
    """`location` (a run's or model version's artifact URI, as the store handed it back) when the rule lets the
    client write to and read from it; raises TrackingUnavailableError naming it otherwise."""
    problem = store_transport.artifact_location_problem(location, tracking or mlflow.get_tracking_uri())
    if problem:
        raise TrackingUnavailableError(f"{problem}. Nothing was sent there.")
    return location


def _check_server(uri: str, timeout: float) -> None:
    shown = redact(uri)
    try:
        response = http_request(
            get_default_host_creds(uri),
            "/api/2.0/mlflow/experiments/search",
            "POST",
            max_retries=0,
            backoff_factor=0,
            timeout=timeout,
            json={"max_results": 1},
        )
    except Exception as err:  # connection refused, DNS, timeout, TLS: all mean "cannot track"
        status = re.search(r"too many (5\d\d) error responses", str(err))
        if status:  # the server is up, what it stores runs in is not (its database down, a full disk)
            raise TrackingUnavailableError(
                f"MLflow tracking server {shown} answered HTTP {status.group(1)}: its backend store failed (is its "
                "database up?). Nothing was run."
            ) from None
        errno = re.search(r"\[Errno -?\d+\] [^\"')]+", str(err))  # the OS reason, without urllib3's wrapping
        reason = redact(errno.group(0) if errno else str(err).split(" failed with exception ")[-1])[:300]
        raise TrackingUnavailableError(
            f"MLflow tracking server {shown} is unreachable ({reason}); start it, or point "
            "tracking.tracking_uri / $MLFLOW_TRACKING_URI at a reachable server or a sqlite:/// file. "
            "Nothing was run."
        ) from None
    if 300 <= response.status_code < 400:
        elsewhere = redact(response.headers.get("Location", "nowhere named"))[:300]
        raise TrackingUnavailableError(
            f"MLflow tracking server {shown} answered HTTP {response.status_code}, a redirect to {elsewhere}: the "
            f"client follows none; point the tracking URI at the server itself (or set {ALLOW_REDIRECTS}=true to "
            "follow it). Nothing was run."
        )
    if response.status_code in (401, 403):
        raise TrackingUnavailableError(
            f"MLflow tracking server {shown} refused the credentials (HTTP {response.status_code}); set "
            "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN. Nothing was run."
        )
    if response.status_code >= 500:  # the server is up, what it stores runs in is not (a database down, a full disk)
        try:
            detail = str(response.json().get("message", ""))
        except ValueError:
            detail = response.text
        raise TrackingUnavailableError(
            f"MLflow tracking server {shown} answered HTTP {response.status_code}: its backend store failed "
            f"({redact(detail.strip())[:400]}). Nothing was run."
        )
    if response.status_code >= 400:
        raise TrackingUnavailableError(
            f"MLflow tracking server {shown} answered HTTP {response.status_code} to an API call: is it an MLflow "
            "server? Nothing was run."
        )


def _check_writable_dir(where: Path, uri: str) -> None:
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as err:
        raise TrackingUnavailableError(
            f"MLflow tracking store {redact(uri)}: cannot write in {where} ({err.strerror or err}); "
            "set tracking.tracking_uri / $MLFLOW_TRACKING_URI to a writable location. Nothing was run."
        ) from None


# ---- secrets never reach MLflow ----------------------------------------------------------------------------

_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_KEY|ACCESS_KEY|PRIVATE_KEY|AUTH", re.I)


def secret_values(environ: dict[str, str] | None = None) -> list[str]:
    """Values of environment variables whose names say they are secrets (tokens, passwords, keys)."""
    environ = os.environ if environ is None else environ
    return sorted({v for k, v in environ.items() if _SECRET_NAME.search(k) and len(v) >= 6}, key=len, reverse=True)


def redact(text: str) -> str:
    """`text` with its URLs' credentials (user info, credential query values: rlhflow.redaction) and secret
    environment values masked."""
    text = redact_urls(text)
    for value in secret_values():
        text = text.replace(value, REDACTED)
    return text


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
        return (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5, check=True
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


# what a pipeline run does not execute: a change here alone leaves its figures as they were
NOT_RUN_PATHS = ("docs", "tests", "bench", ".ci", "*.md")


def same_code(commit: str, other: str = "HEAD", root: Path = REPO_ROOT) -> bool:
    """Whether two commits hold the same code: no difference outside NOT_RUN_PATHS. False when git cannot tell (no
    repository, an unknown commit)."""
    excludes = [f":(exclude){path}" for path in NOT_RUN_PATHS]
    try:
        diff = subprocess.run(
            ["git", "diff", "--quiet", commit, other, "--", ".", *excludes],
            cwd=root,
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return diff.returncode == 0


@contextlib.contextmanager
def start_run(
    cfg: Config, *, name: str, params: dict[str, Any], tags: dict[str, str], parent_run_id: str | None = None
) -> Iterator[Any]:
    """A run that is marked FAILED (and re-raises) when the body raises, FINISHED otherwise."""
    mlflow = setup(cfg)
    commit = git_commit()
    tags = {**tags, **({"git_commit": commit, GIT_COMMIT_TAG: commit} if commit else {})}
    run = mlflow.start_run(run_name=name, parent_run_id=parent_run_id, nested=parent_run_id is not None, tags=tags)
    try:
        check_artifact_location(run.info.artifact_uri)  # before any file goes where the store says
        if params:
            mlflow.log_params(
                {k: "null" if v is None else redact(v) if isinstance(v, str) else v for k, v in flatten(params).items()}
            )
        yield run
    except BaseException as err:
        mlflow.set_tag("error", redact(f"{type(err).__name__}: {err}")[:5000])
        mlflow.end_run(status="FAILED")
        raise
    else:
        mlflow.end_run(status="FINISHED")


PARAMS_DIGEST_TAG = "params_md5"
# Options added after runs were recorded, each with the value that leaves a run as it was: at that value the key is
# left out of the digest, so earlier runs keep theirs (a sweep's reuse and `--table-only` still find them).
DIGEST_NEUTRAL = {"ppo.fp32_lm_head": False, "judge.allow_plain_http": False}


def params_digest(cfg: Config) -> str:
    """md5 of the run's fully resolved params: runs with the same digest were configured identically."""

    params = copy.deepcopy(cfg.to_params())
    for key, neutral in DIGEST_NEUTRAL.items():
        *path, name = key.split(".")
        section = functools.reduce(lambda d, k: d.get(k, {}), path, params)
        if section.get(name, neutral) == neutral:
            section.pop(name, None)
    return hashlib.md5(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()


def pipeline_run(cfg: Config, *, run_name: str = "pipeline", parent_run_id: str | None = None, tags=None):
    """The parent run of a pipeline run (nested under `parent_run_id`, a sweep's run, when given)."""
    tags = {"pipeline": "rlhf", PARAMS_DIGEST_TAG: params_digest(cfg), **(tags or {})}
    return start_run(cfg, name=run_name, params=cfg.to_params(), tags=tags, parent_run_id=parent_run_id)


def stage_run(cfg: Config, stage: str, sections: list[str], parent_run_id: str | None = None):
    params = {s: cfg.section(s) for s in sections}
    return start_run(cfg, name=stage, params=params, tags={"stage": stage}, parent_run_id=parent_run_id)


def valued(metrics: dict[str, float | None], *, keep_nan: bool = False) -> dict[str, float]:
    """The metrics that have a value. None is no value; so is NaN in a stage's summary (an accuracy over no pairs),
    left out of MLflow and of metrics/<stage>.json alike so that the two hold the same keys. A training curve
    (`keep_nan`) keeps its NaN: a loss that diverged must show."""
    return {k: float(v) for k, v in metrics.items() if v is not None and (keep_nan or not math.isnan(float(v)))}


def log_metrics(metrics: dict[str, float], *, run_ids: list[str | None] = (), step: int | None = None) -> None:
    """Log to the active run and to any other given runs (the evaluate stage also logs on the parent)."""

    clean = valued(metrics, keep_nan=step is not None)
    mlflow.log_metrics(clean, step=step)
    now = int(time.time() * 1000)
    batch = [Metric(key, value, now, step or 0) for key, value in clean.items()]
    for run_id in run_ids:
        if run_id and batch:
            client().log_batch(run_id, metrics=batch)  # one request, not one per metric


def log_dataset(path: str | os.PathLike, *, name: str, context: str) -> str:
    """Log a JSONL/Parquet dataset as a run input whose digest is its DVC md5."""

    path = Path(path)
    digest = file_md5(path)
    df = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_json(path, lines=True)
    df = df[[c for c in df.columns if df[c].map(lambda v: isinstance(v, (str, int, float))).all()]]
    # integer columns (source_row) as doubles: MLflow warns that an inferred integer column cannot hold missing
    # values; the schema only describes the file, whose digest is the md5 above
    df = df.astype({c: "float64" for c in df.select_dtypes("integer").columns})
    dataset = mlflow.data.from_pandas(df, source=_local_dataset_source(path), name=name, digest=digest)
    mlflow.log_input(dataset, context=context)
    return digest


def _local_dataset_source(path: Path):
    """MLflow's source for a local file. MLflow registers it twice (URI schemes "" and "file"), so resolving a
    plain path warns that it "can be interpreted in multiple ways"; both are the same class: take the one MLflow
    would (the last registered). A string (resolved by MLflow) when a later MLflow names it differently."""

    local = [s for s in get_registered_sources() if s.__name__ == "LocalArtifactDatasetSource"]
    return local[-1](str(path)) if local else str(path)


REGISTERED_MODELS_TAG = "registered_models"


def link_stage_runs(parent_run_id: str) -> list[str]:
    """The parent run lists what its stage runs used and made, so its page shows them: their datasets as its
    inputs, their logged models as its outputs, and the registry versions they created as the tag
    `registered_models` ("name/version, ..."). Returns those versions."""

    store = client()
    parent = store.get_run(parent_run_id)
    children = store.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_run_id}'", order_by=["start_time ASC"]
    )
    seen = {(d.dataset.name, d.dataset.digest) for d in parent.inputs.dataset_inputs}
    datasets, models, versions = [], [], []
    for child in children:
        for inp in child.inputs.dataset_inputs:
            if (inp.dataset.name, inp.dataset.digest) not in seen:
                seen.add((inp.dataset.name, inp.dataset.digest))
                datasets.append(inp)
        models += child.outputs.model_outputs if child.outputs else []
        versions += [f"{v.name}/{v.version}" for v in store.search_model_versions(f"run_id = '{child.info.run_id}'")]
    if datasets:
        store.log_inputs(parent_run_id, datasets=datasets)
    if models:
        store.log_outputs(parent_run_id, models)
    if versions:
        store.set_tag(parent_run_id, REGISTERED_MODELS_TAG, ", ".join(versions))
    return versions


def write_stage_metrics(cfg: Config, stage: str, metrics: dict[str, float]) -> Path:
    """metrics/<stage>.json: what `dvc metrics show` lists; the same numbers MLflow has."""
    path = cfg.path(cfg.metrics_dir) / f"{stage}.json"
    write_json_atomic(path, valued(metrics))
    return path
