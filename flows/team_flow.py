"""The team pipeline's Prefect flows: the dispatcher `team_pipeline`, which holds the MLflow parent run and sends each
stage to a worker of the pool, and `stage_on_worker`, one stage in a worker's clone; their deployments and a run
started through the API. What `python -m flows.team` runs once its command line is parsed (flows/team.py, the
command, hands every name here on: the deployments' entrypoints are `flows.team.<flow>`). How a run goes, and its
faults: flows/team.py's docstring and docs/scaling.md, A team's stack.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import mlflow
import yaml
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.deployments import run_deployment
from prefect.runtime import flow_run
from prefect.states import Crashed
from prefect.utilities.callables import parameter_schema
from prefect.workers.process import ProcessWorker

from flows.pipeline_flow import (
    check_up_to_date,
    ensure_training_limit,
    launched_stage,
    record_stage,
    selected_stages,
    with_overrides,
)
from rlhflow.config.params import REPO_ROOT, Config
from rlhflow.evaluation import judging
from rlhflow.redaction import user_info_removed
from rlhfops import launch, restore, tracking, workspace
from rlhfops.run_record import artifact_dir
from rlhfops.stack_access import restricted_job_template
from rlhfops.stage_lock import LOCK_FILE, PARAMS_FILE, lock_entry, uncached_outputs
from rlhfops.stages import get_stage
from rlhfops.training_slot import TRAINING_LIMIT, training_slot

POOL = "rlhf"
HEAVY_QUEUE = "heavy"
LIGHT_QUEUE = "light"
STAGE_FLOW = "rlhf-stage-on-worker"
TEAM_DEPLOYMENT = "rlhf-team-pipeline/team"
WORKER_TAG = "worker."  # + stage: which worker ran it, on the parent run
# A worker's training slot is leased for this long and renewed while the stage runs: a stage killed with its
# process gives the slot back within about this time (the server's lease revocation), not Prefect's default 5 min.
SLOT_LEASE_S = 60.0
PREFECT_WORKER_TAG = "prefect_worker."  # + stage: the Prefect worker process that took it
FLOW_RUN_TAG = "prefect_flow_run_id"  # the dispatcher's flow run, on the parent run


class StageFailed(RuntimeError):
    """A stage's flow run on a worker did not complete."""


def worker_name() -> str:
    """The worker running this flow run: $RLHF_WORKER (rlhfops/stack.py sets it), else the Prefect worker's name
    (the process worker exports it), else the host."""

    return os.environ.get("RLHF_WORKER") or os.environ.get("PREFECT__WORKER_NAME") or socket.gethostname()


def queue_of(stage: str) -> str:
    return HEAVY_QUEUE if get_stage(stage).accelerator else LIGHT_QUEUE


@flow(name=STAGE_FLOW, log_prints=True)
def stage_on_worker(
    stage: str, config: Config, lock: dict[str, Any], parent_run_id: str, remote: str | None = None, force: bool = False
) -> None:
    """One stage of a team pipeline run, in this worker's clone.

    Args:
        stage: the stage to run
        config: the run's params
        lock: the lock entries (stage -> entry) of the stages before it in this run: its inputs
        parent_run_id: the run's MLflow parent run (the stage's run is its child)
        remote: the DVC remote to pull inputs from and push outputs to; empty: DVC's default remote
        force: run the stage even when it is up to date
    """

    os.chdir(REPO_ROOT)  # the worker starts flow runs in a temporary directory; DVC works from the clone
    cfg, worker = config, worker_name()
    client = tracking.client(tracking.tracking_uri(cfg))
    client.set_tag(parent_run_id, WORKER_TAG + stage, worker)
    if os.environ.get("PREFECT__WORKER_NAME"):
        client.set_tag(parent_run_id, PREFECT_WORKER_TAG + stage, os.environ["PREFECT__WORKER_NAME"])
    print(f"{stage}: on worker {worker}, clone {REPO_ROOT}")
    with workspace.exclusive(f"stage {stage} of run {parent_run_id} on worker {worker}"):
        if lock:  # the inputs, as the run made them, whatever this clone last ran
            with tempfile.TemporaryDirectory() as tmp:  # the uncached ones (metrics) from the parent run
                outputs = Path(client.download_artifacts(parent_run_id, "outputs", tmp))
                pulled = restore.restore_lock(lock, cfg, remote, outputs)
            bad = [r.path for r in pulled if not r.ok]
            if bad:
                raise restore.RestoreError(f"{stage}: inputs differ from the run's record after the pull: {bad}")
            print(f"{stage}: {len(pulled)} input(s) checked out by md5")
        limit = f"{TRAINING_LIMIT}-{worker}"
        if get_stage(stage).accelerator:
            with training_slot(stage, limit, ensure_training_limit(limit), lease_s=SLOT_LEASE_S):
                ran = _run_stage(stage, cfg, parent_run_id, force)
        else:
            ran = _run_stage(stage, cfg, parent_run_id, force)
        entry = lock_entry(get_stage(stage), cfg)
        if entry is None:
            raise StageFailed(f"{stage}: no dvc.lock entry after the stage on worker {worker}")
        sent = restore.push_run({"stages": {stage: entry}}, cfg, remote)
        print(f"{stage}: {'ran' if ran else 'up to date'}; pushed {sent} new object(s) to the DVC remote")
        # the parent run learns of the stage only now, once its outputs are in the remote
        for template in uncached_outputs(get_stage(stage)):
            rel = get_stage(stage).resolve(cfg, template)
            if cfg.path(rel).is_file():
                client.log_artifact(parent_run_id, str(cfg.path(rel)), artifact_dir(rel))
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"{stage}.lock.yaml"
            path.write_text(yaml.safe_dump({"entry": entry, "ran": ran, "worker": worker}, sort_keys=False))
            client.log_artifact(parent_run_id, str(path), "stages")


def _run_stage(name: str, cfg: Config, parent_id: str, force: bool) -> bool:
    """Run the stage (unless DVC finds it up to date) and record it; whether it ran."""

    reasons = ["forced"] if force else check_up_to_date(name, cfg)
    if not reasons:
        print(f"{name}: skipped, up to date")
        return False
    print(f"{name}: running ({'; '.join(reasons[:3])})")
    if launch.processes(name, cfg) > 1:
        launched_stage.with_options(name=name)(name, cfg, parent_id)
    else:
        importlib.import_module(f"tasks.{name}").task(cfg, parent_id)
    record_stage(name, cfg)
    return True


@flow(name="rlhf-team-pipeline", log_prints=True)
def team_pipeline(
    config: Config | None = None,
    stages: list[str] | None = None,
    force: bool = False,
    overrides: list[str] | None = None,
    remote: str | None = None,
) -> dict[str, float]:
    """The RLHF pipeline with each stage on a worker of the pool (flows/team.py).

    Args:
        config: every hyperparameter (params.yaml; its values are the defaults)
        stages: run only these stages (in pipeline order); empty: all
        force: run every stage even when it is up to date
        overrides: params.yaml overrides applied on top of `config`, e.g. ["ppo.kl_coef=0.1"]
        remote: the DVC remote the workers share; empty: DVC's default remote
    """

    os.chdir(REPO_ROOT)
    cfg = with_overrides(config, overrides)
    uri = tracking.tracking_uri(cfg)
    # every stage on every worker logs to the store this run resolved, whatever their environments say
    cfg, stage_cfg = with_tracking_uri(cfg, uri), with_tracking_uri(cfg, user_info_removed(uri))
    names = selected_stages(cfg, stages)
    tracking.preflight(cfg)
    judging.preflight(cfg.judge)
    remote = restore.check_remote(remote)  # unreachable store or wrong credentials: fails here, in seconds
    results: dict[str, float] = {}
    tags = {"dispatch": "work-pool", FLOW_RUN_TAG: str(flow_run.get_id())}
    with tracking.pipeline_run(cfg, run_name="pipeline on workers", tags=tags) as parent:
        parent_id = parent.info.run_id
        print(f"MLflow parent run {parent_id} at {tracking.redact(uri)}")
        lock: dict[str, Any] = {"schema": "2.0", "stages": {}}
        client = tracking.client(uri)
        for name in names:
            start = time.perf_counter()
            dispatch_stage(name, stage_cfg, lock, parent_id, client, remote=remote, force=force)
            record = _stage_record(client, parent_id, name)
            lock["stages"][name] = record["entry"]
            metrics = _stage_metrics(client, parent_id, cfg, name)
            results.update(metrics)
            if record["ran"]:
                results[f"time/{name}_s"] = time.perf_counter() - start
            print(f"{name}: {'ran' if record['ran'] else 'up to date'} on {record['worker']}")
        tracking.log_metrics(results)
        tracking.link_stage_runs(parent_id)
        mlflow.log_text(tracking.redact(yaml.safe_dump(lock, sort_keys=False)), LOCK_FILE)
        mlflow.log_text(tracking.redact(yaml.safe_dump(cfg.to_params(), sort_keys=False)), PARAMS_FILE)
    return results


def dispatch_stage(name: str, stage_cfg: Config, lock: dict, parent_id: str, client, *, remote, force: bool) -> None:
    """Run stage `name` on a worker of its queue (given the lock entries of the stages before it) and wait for it;
    a stage that did not complete raises StageFailed naming the worker and the flow run's state."""

    run = run_deployment(
        f"{STAGE_FLOW}/{queue_of(name)}",
        parameters=dict(
            stage=name,
            config=stage_cfg,
            lock=dict(lock["stages"]),
            parent_run_id=parent_id,
            remote=remote,
            force=force,
        ),
        timeout=0,
        as_subflow=True,
    )
    run = wait_for_stage(run, name, parent_id, client)
    worker = client.get_run(parent_id).data.tags.get(WORKER_TAG + name, "(none took it)")
    if not run.state.is_completed():
        raise StageFailed(
            f"stage {name} on worker {worker}: flow run {run.name!r} {run.state.name}: "
            f"{(run.state.message or '').strip()[:1000]}"
        )


def with_tracking_uri(cfg: Config, uri: str) -> Config:
    """`cfg` logging to `uri`. The stage runs get the URI without user info: Prefect stores and shows their
    parameters, and each worker adds the credentials its own environment holds for that store (tracking.tracking_uri:
    its $MLFLOW_TRACKING_URI, else MLflow's $MLFLOW_TRACKING_USERNAME/PASSWORD)."""
    return cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"tracking_uri": uri})})


# A worker that sent no heartbeat for this many of its heartbeat intervals is gone (Prefect's own rule, which its
# server applies only every foreman loop).
MISSED_HEARTBEATS = 3


def wait_for_stage(flow_run: Any, stage: str, parent_id: str, mlflow_client: Any, poll_s: float = 2.0) -> Any:
    """Wait for a stage's flow run to end. A run whose worker stops sending heartbeats (the machine or the worker
    died: no one is left to report the run) is marked Crashed, naming the worker, instead of being waited for."""

    with get_client(sync_client=True) as prefect:
        while True:
            run = prefect.read_flow_run(flow_run.id)
            if run.state.is_final():
                return run
            taken_by = mlflow_client.get_run(parent_id).data.tags.get(PREFECT_WORKER_TAG + stage)
            if taken_by and run.state.is_running():
                now = datetime.now(timezone.utc)
                worker = next((w for w in prefect.read_workers_for_work_pool(POOL) if w.name == taken_by), None)
                beat = worker.last_heartbeat_time if worker else None
                silent = (now - beat).total_seconds() if beat else 0.0 if worker else float("inf")
                interval = (worker.heartbeat_interval_seconds if worker else None) or 30
                if silent > MISSED_HEARTBEATS * interval:
                    message = f"Prefect worker {taken_by} went silent {silent:.0f} s ago while running the stage"
                    prefect.set_flow_run_state(run.id, Crashed(message=message), force=True)
                    return prefect.read_flow_run(run.id)
            time.sleep(poll_s)


def _stage_record(client: Any, run_id: str, stage: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = client.download_artifacts(run_id, f"stages/{stage}.lock.yaml", tmp)
        return yaml.safe_load(Path(path).read_text())


def _stage_metrics(client: Any, run_id: str, cfg: Config, stage: str) -> dict[str, float]:
    """The stage's metrics file as its worker logged it on the parent run."""
    rel = os.path.normpath(f"{cfg.metrics_dir}/{stage}.json")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = client.download_artifacts(run_id, f"{artifact_dir(rel)}/{Path(rel).name}", tmp)
        except Exception:  # a stage with no metrics file
            return {}
        metrics = json.loads(Path(path).read_text())
    return {k: v for k, v in metrics.items() if not k.startswith("time/")}


# ---- deployments and runs through the API -----------------------------------------------------------------------


def deploy(pool: str = POOL) -> list[str]:
    """Create (or update) the process work pool `pool` on the server in $PREFECT_API_URL, its job template
    restricted (rlhfops.stack_access.restricted_job_template: no flow run chooses a worker's command, environment
    or directory), and in it the dispatcher's and the stage flow's deployments. Returns their names."""

    made = []
    template = restricted_job_template(ProcessWorker.get_default_base_job_template())
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process", base_job_template=template), overwrite=True)
        for fn, name, queue in (
            (team_pipeline, "team", LIGHT_QUEUE),
            (stage_on_worker, HEAVY_QUEUE, HEAVY_QUEUE),
            (stage_on_worker, LIGHT_QUEUE, LIGHT_QUEUE),
        ):
            client.create_deployment(
                flow_id=client.create_flow_from_name(fn.name),
                name=name,
                work_pool_name=pool,
                work_queue_name=queue,
                entrypoint=f"flows.team.{fn.fn.__name__}",  # a module path: the worker's clone provides it
                parameter_openapi_schema=parameter_schema(fn).model_dump_for_openapi(),
                pull_steps=[],
                enforce_parameter_schema=False,
            )
            made.append(f"{fn.name}/{name}")
    return made


def start_run(overrides: list[str] | None = None, stages: list[str] | None = None, timeout: float | None = None):
    """A team pipeline run through the Prefect API; waits `timeout` seconds for it (None: until it ends) and
    returns the flow run."""

    return run_deployment(TEAM_DEPLOYMENT, parameters={"overrides": overrides or [], "stages": stages}, timeout=timeout)
