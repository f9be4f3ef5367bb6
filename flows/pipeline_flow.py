"""The pipeline's Prefect flow, `rlhf_pipeline`, and its tasks: what `python -m flows.pipeline` runs once its command
line is parsed. flows/pipeline.py, the command, hands every name here on (`flows.pipeline.rlhf_pipeline` is this
flow); how a run goes is told there and in docs/prefect.md. The other flows (stage_flows, sweep, feedback, team)
build on `run_pipeline` and these tasks.
"""

from __future__ import annotations

import errno
import importlib
import json
import logging
import sys
import time
from typing import Any, Literal

import mlflow
from prefect import flow, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.runtime import flow_run
from prefect.tasks import exponential_backoff
from prefect.utilities.urls import url_for

from flows import report
from rlhflow.config.params import Config, apply_overrides, config_from_dict, load_config
from rlhflow.evaluation import judging
from rlhfops import launch, prefect_replies, restore, run_record, stage_lock, tracking, workspace
from rlhfops.stages import STAGE_NAMES, STAGES, get_stage
from rlhfops.training_slot import TRAINING_LIMIT, training_slot

# every reply of the Prefect server read within bounds of size and time (rlhfops/prefect_replies.py)
prefect_replies.bound_prefect_replies()

StageName = Literal[tuple(STAGE_NAMES)]  # an enum in the parameter form

TRAINING_LIMIT_DEFAULT_SLOTS = 1  # of the training limit, when ensure_training_limit creates it

# errors a retry may fix, by class name where the class belongs to a library imported lazily
_TRANSIENT_NAMES = {
    "OperationalError",
    "LockError",
    "ConnectError",
    "ConnectTimeout",
    "ReadTimeout",
    "RemoteProtocolError",
}


# a full disk or quota, as an OSError's errno or in the message of what wraps it (sqlite, torch, safetensors)
_DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_DISK_FULL_MESSAGES = ("no space left on device", "disk quota exceeded", "database or disk is full")


def _disk_full(err: BaseException) -> bool:
    """Whether `err`, or an error it was raised from or while handling, says the disk or quota is full."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _DISK_FULL_ERRNOS:
            return True
        if any(text in str(current).lower() for text in _DISK_FULL_MESSAGES):
            return True
        current = current.__cause__ or current.__context__
    return False


def is_transient(err: BaseException) -> bool:
    """A failure a retry may fix: the network, a server restarting, a busy database or lock; not a missing file, a
    bad setting, a directory that is no git repository or a full disk, which fail the same way every time (a full
    disk retried only fills it again)."""
    if isinstance(err, (FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError)):
        return False
    if _disk_full(err):
        return False
    if isinstance(err, (ConnectionError, TimeoutError, OSError)):
        return True
    return any(cls.__name__ in _TRANSIENT_NAMES for cls in type(err).__mro__)


def _retry_if_transient(task, task_run, state) -> bool:
    err = getattr(state, "data", None)
    return is_transient(err) if isinstance(err, BaseException) else True


# Transient failures (a busy disk, a Prefect or MLflow server restarting) are retried: 2, 4, 8 s (+ jitter); other
# errors fail at once.
TRANSIENT_RETRIES = dict(
    retries=3,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    retry_jitter_factor=0.5,
    retry_condition_fn=_retry_if_transient,
    cache_policy=NO_CACHE,
)


# the flow's own bookkeeping tasks: a run log names their failures and retries, not each completion
BOOKKEEPING_TASKS = frozenset(
    {"ensure-training-limit", "check-up-to-date", "record-stage", "log-lineage", "publish-report"}
)


class TaskRunLines(logging.Filter):
    """Prefect ends each task run with "Finished in state Completed()", and the UI's log of a flow run shows it
    without the task's name: a task's line names it ("ppo finished in state Completed()"), and a bookkeeping task's
    completion is left out (its failure stays)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith("Finished in state "):
            return True
        name = getattr(record, "task_name", None)
        if name in BOOKKEEPING_TASKS and record.levelno < logging.WARNING:
            return False
        if name:
            record.msg, record.args = f"{name} finished in state {message[len('Finished in state ') :]}", ()
        return True


if not any(isinstance(f, TaskRunLines) for f in logging.getLogger("prefect.task_runs").filters):
    logging.getLogger("prefect.task_runs").addFilter(TaskRunLines())


def selected_stages(cfg: Config, stages: list[str] | None) -> list[str]:
    names = list(stages) if stages else [s.name for s in STAGES]
    unknown = [n for n in names if n not in STAGE_NAMES]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; stages: {STAGE_NAMES}")
    # demo_data runs even when another file is the input, as under `dvc repro`: every stage of dvc.yaml then has
    # its dvc.lock entry after a flow run (it writes a small deterministic file in well under a second)
    return [n for n in STAGE_NAMES if n in names]  # pipeline order, whatever order they were given in


# The settings a person changes most, each a field of the deployments' short form: (parameter, params.yaml key, title)
FORM_SETTINGS = (
    ("seed", "seed", "Seed"),
    ("ppo_steps", "ppo.steps", "PPO steps"),
    ("kl_coef", "ppo.kl_coef", "PPO KL weight"),
    ("algorithm", "align.algorithm", "Algorithm"),
    ("judge_kind", "judge.kind", "Judge"),
    ("preferences", "data.preferences", "Preference data"),
)


def form_overrides(form: dict[str, Any], overrides: list[str] | None) -> list[str]:
    """The short form's filled-in fields (`form`: a flow's parameters by name) as overrides, then `overrides` (the
    later of two for one key wins)."""
    filled = [f"{key}={form[name]}" for name, key, _ in FORM_SETTINGS if form.get(name) is not None]
    return filled + [*(overrides or [])]


def with_overrides(cfg: Config | None, overrides: list[str] | None) -> Config:
    """A flow's `config` parameter (None: params.yaml, read now, as the run starts) with `overrides` applied."""
    cfg = load_config() if cfg is None else cfg
    return config_from_dict(apply_overrides(cfg.to_params(), overrides)) if overrides else cfg


@task(name="ensure-training-limit", **TRANSIENT_RETRIES)
def ensure_training_limit(limit: str = TRAINING_LIMIT) -> int:
    """Create the global concurrency limit `limit` with TRAINING_LIMIT_DEFAULT_SLOTS when it does not exist; a
    limit the user changed (`prefect gcl update`) is left as it is. Returns its slots."""

    with get_client(sync_client=True) as client:
        try:
            return client.read_global_concurrency_limit_by_name(limit).limit
        except ObjectNotFound:
            pass
        try:
            client.create_global_concurrency_limit(
                GlobalConcurrencyLimitCreate(name=limit, limit=TRAINING_LIMIT_DEFAULT_SLOTS)
            )
        except ObjectAlreadyExists:  # another run created it in between
            pass
        return client.read_global_concurrency_limit_by_name(limit).limit


@task(name="check-up-to-date", **TRANSIENT_RETRIES)
def check_up_to_date(name: str, cfg: Config) -> list[str]:
    """Why the stage must run (empty: it is up to date)."""
    return stage_lock.why_stale(get_stage(name), cfg)


@task(name="record-stage", **TRANSIENT_RETRIES)
def record_stage(name: str, cfg: Config) -> None:
    stage_lock.record_run(get_stage(name), cfg)


@task(name="log-lineage", **TRANSIENT_RETRIES)
def log_lineage(cfg: Config, names: list[str]) -> dict:
    """The parent run's `dvc.lock`, `params.yaml` and uncached outputs (what `flows.restore` reads back); a run
    with overrides also becomes a DVC experiment."""
    return run_record.log_run_lineage(cfg, names)


@task(name="push-outputs", **TRANSIENT_RETRIES)
def push_outputs(lock: dict, cfg: Config, remote: str | None) -> None:
    """The run's data and models to a DVC remote, for `flows.restore` on another machine."""

    sent = restore.push_run(lock, cfg, remote)
    mlflow.set_tag("dvc.remote", remote or "default")
    print(f"pushed {sent} new object(s) to the DVC remote {remote or '(default)'}")


@task(name="publish-report", **TRANSIENT_RETRIES)
def publish_report(markdown: str, run_url: str | None) -> None:
    create_markdown_artifact(
        markdown,
        key=report.REPORT_KEY,
        description="RLHF pipeline run: stages, metrics, validation, evaluation samples",
    )
    if run_url:
        create_link_artifact(
            run_url,
            link_text="MLflow run",
            key=report.LINK_KEY,
            description="This run's MLflow parent run (stage runs, metrics, models)",
        )


@task(name="launched-stage", retries=0, cache_policy=NO_CACHE)
def launched_stage(name: str, cfg: Config, parent_run_id: str) -> dict[str, float]:
    """A data-parallel stage in `launch.<stage>` processes (rlhfops/launch.py); no retries, as for every stage."""
    return launch.run_in_processes(name, cfg, parent_run_id)


def recorded_metrics(cfg: Config, name: str) -> dict[str, float]:
    """metrics/<stage>.json of the last run of a skipped stage (its wall time is not this run's)."""
    path = cfg.path(cfg.metrics_dir) / f"{name}.json"
    metrics = json.loads(path.read_text()) if path.exists() else {}
    return {k: v for k, v in metrics.items() if not k.startswith("time/")}


def run_or_skip(name: str, cfg: Config, parent_id: str, force: bool) -> tuple[report.StageOutcome, dict[str, float]]:
    reasons = ["forced"] if force else check_up_to_date(name, cfg)
    if not reasons:
        metrics = recorded_metrics(cfg, name)
        print(f"{name}: skipped, up to date (deps, params and outputs as recorded after its last run)")
        tracking.log_metrics(metrics)  # the parent run still shows the stage's figures
        return report.StageOutcome(name, ran=False, reason="up to date"), metrics
    print(f"{name}: running ({'; '.join(reasons[:3])}{'; ...' if len(reasons) > 3 else ''})")
    start = time.perf_counter()
    if launch.processes(name, cfg) > 1:  # `accelerate launch` of the stage's CLI, under this parent run
        metrics = launched_stage.with_options(name=name)(name, cfg, parent_id)
    else:
        metrics = importlib.import_module(f"tasks.{name}").task(cfg, parent_id)
    seconds = time.perf_counter() - start
    record_stage(name, cfg)
    return report.StageOutcome(name, ran=True, seconds=seconds, reason=reasons[0]), metrics


def run_pipeline(
    cfg: Config,
    stages: list[str] | None = None,
    force: bool = False,
    push: bool = False,
    remote: str | None = None,
    parent_run: str | None = None,
) -> dict[str, float]:
    """The body of every flow here: the selected stages, in order, in one MLflow parent run (nested under the
    MLflow run `parent_run`, a sweep's, when given); with `push`, their outputs then go to the DVC remote `remote`
    (default: DVC's default remote)."""
    names = selected_stages(cfg, stages)
    tracking.preflight(cfg)  # an unreachable tracking server fails here, in seconds, not after training
    judging.preflight(cfg.judge)  # so does a judge endpoint or model that cannot be used
    if push:
        restore.check_remote(remote)  # so does a push with no DVC remote to go to
    # one run at a time per workspace: a second run waits here for the whole first run (rlhfops/workspace.py)
    with workspace.exclusive(this_run_name()):
        return _run_stages(cfg, names, force, push, remote, parent_run)


# the Prefect flow run an MLflow parent run belongs to: its id, its name (as Prefect's UI shows it) and its page
PREFECT_RUN_TAGS = ("prefect.flow_run_id", "prefect.flow_run_name", "prefect.flow_run_url")


def prefect_run_tags() -> dict[str, str]:
    """The tags that name, on the MLflow parent run, the Prefect flow run making it (none outside a flow run)."""
    run_id = flow_run.get_id()
    if not run_id:
        return {}
    url = url_for("flow-run", obj_id=run_id)  # None where no Prefect UI is configured
    values = (str(run_id), flow_run.get_name(), tracking.redact(url) if url else None)
    return {key: value for key, value in zip(PREFECT_RUN_TAGS, values) if value}


def this_run_name() -> str:
    """How other runs waiting for the workspace name this one: the Prefect flow run, else the command."""

    name = flow_run.get_name() if flow_run.get_id() else None
    return f"pipeline flow run {name!r}" if name else f"pipeline run ({' '.join(sys.argv[:1] + sys.argv[1:4])})"


def _run_stages(
    cfg: Config, names: list[str], force: bool, push: bool, remote: str | None, parent_run: str | None
) -> dict[str, float]:
    slots = ensure_training_limit() if any(get_stage(n).accelerator for n in names) else 0
    results: dict[str, float] = {}
    outcomes: list[report.StageOutcome] = []
    run_url, error, parent_id, prefect = None, None, None, prefect_run_tags()
    run_name = "pipeline" if names == selected_stages(cfg, None) else "stages: " + ",".join(names)
    try:
        with tracking.pipeline_run(cfg, run_name=run_name, parent_run_id=parent_run, tags=prefect) as parent:
            uri, parent_id = tracking.tracking_uri(cfg), parent.info.run_id
            run_url = report.mlflow_run_url(uri, parent.info.experiment_id, parent.info.run_id)
            print(
                f"MLflow parent run {parent.info.run_id} in experiment {cfg.tracking.experiment!r} at "
                f"{tracking.redact(uri)}: {run_url} (all runs: "
                f"{report.mlflow_experiment_url(uri, parent.info.experiment_id)})"
            )
            for name in names:
                if get_stage(name).accelerator:  # a second pipeline run waits here for the first one's stage
                    with training_slot(name, TRAINING_LIMIT, slots):
                        outcome, metrics = run_or_skip(name, cfg, parent.info.run_id, force)
                else:
                    outcome, metrics = run_or_skip(name, cfg, parent.info.run_id, force)
                outcomes.append(outcome)
                results.update(metrics)
            skipped = [o.name for o in outcomes if not o.ran]
            if skipped:
                mlflow.set_tag("skipped_stages", ",".join(skipped))
            tracking.log_metrics({k: v for k, v in results.items() if k.startswith("time/")})
            lock = log_lineage(cfg, names)
            if push:
                push_outputs(lock, cfg, remote)
    except BaseException as err:
        error = tracking.redact(f"{type(err).__name__}: {err}")[:2000]
        raise
    finally:
        if run_url or error:
            try:
                publish_report(report.report_markdown(cfg, outcomes, results, run_url, error), run_url)
                if parent_id:  # the run's page in MLflow opens on its description
                    made_by = (prefect.get("prefect.flow_run_name"), prefect.get("prefect.flow_run_url"))
                    description = report.run_description(outcomes, results, error, made_by)
                    tracking.client().set_tag(parent_id, tracking.RUN_DESCRIPTION_TAG, description)
            except Exception as err:  # never hide the pipeline's own error behind a reporting one
                if error is None:
                    raise
                print(f"could not publish the run report: {err}")
    print(report.summary_table(results))
    return results


@flow(name="rlhf-pipeline", log_prints=True)
def rlhf_pipeline(
    config: Config | None = None,
    stages: list[StageName] | None = None,
    force: bool = False,
    overrides: list[str] | None = None,
    push: bool = False,
    remote: str | None = None,
    parent_run: str | None = None,
    seed: int | None = None,
    ppo_steps: int | None = None,
    kl_coef: float | None = None,
    algorithm: str | None = None,
    judge_kind: str | None = None,
    preferences: str | None = None,
) -> dict[str, float]:
    """The RLHF pipeline: demo_data -> validate -> sft -> reward_model -> judge -> ppo -> evaluate.

    Args:
        config: every hyperparameter (params.yaml; its values are the defaults)
        stages: run only these stages (in pipeline order), reading earlier outputs from disk; empty: all
        force: run every stage even when it is up to date
        overrides: any params.yaml value, as `section.key=value` (checked as `--set` is), e.g. ["ppo.kl_coef=0.1"]
        push: after the run, push its data and models to a DVC remote (restorable on another machine)
        remote: the DVC remote to push to (`dvc remote list`); empty: DVC's default remote
        parent_run: the MLflow run to nest this run's parent run under (a sweep's run); empty: none
        seed: the training seed (seed); empty: params.yaml's
        ppo_steps: PPO updates (ppo.steps); empty: params.yaml's
        kl_coef: the KL penalty's weight (ppo.kl_coef); empty: params.yaml's
        algorithm: ppo, grpo, rloo or dpo (align.algorithm); empty: params.yaml's
        judge_kind: trained, reward_model or llm (judge.kind); empty: params.yaml's
        preferences: the preference data, a file in the project or a Hub id (data.preferences); empty: params.yaml's
    """
    overrides = form_overrides(locals(), overrides)  # the form's fields: the parameters of those names
    return run_pipeline(with_overrides(config, overrides), stages, force, push, remote, parent_run)
