"""The team stack, started for real on 127.0.0.1 (rlhfops/stack.py): PostgreSQL behind the MLflow server and the
Prefect server, SeaweedFS's S3 holding MLflow's artifacts and the DVC remote, two workers in their own clones.
Tiny pipelines started through the Prefect API run their stages across both workers (flows/team.py), two at once;
a third clone restores one by its MLflow id; a stage process killed mid-stage fails its run naming the stage and
the worker, and leaves nothing in the remote or the registry; an unreachable store or wrong credentials fail in
preflight, in seconds. `make test-stack` (.ci/run calls it)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import make_dvc_repo

pytestmark = [pytest.mark.stack, pytest.mark.slow, pytest.mark.system]

HEAVY = {"sft", "reward_model", "judge", "sft_answers", "ppo", "evaluate"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    from rlhfops.stack import Stack

    root = tmp_path_factory.mktemp("team")
    make_dvc_repo(root / "repo", tiny_model_dir)
    hang = root / "hang-ppo"  # tests.fixtures.prompt_length_reward never returns while this file exists
    with Stack(
        root / "stack",
        repo=root / "repo",
        workers=2,
        worker_env={"RLHF_TEST_HANG_WHEN": str(hang), "OMP_NUM_THREADS": "1"},
        keep_data=False,
    ) as s:
        s.hang_marker = hang
        yield s


def _env(stack, clone: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    return {**env, **stack.client_env(), "PYTHONPATH": str(clone), "PREFECT_HOME": str(stack.root / "client-home")}


def _team_run(stack, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "flows.team", "run"] + [a for o in overrides for a in ("--set", o)]
    return subprocess.Popen(
        cmd, cwd=stack.repo, env=_env(stack, stack.repo), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _parents(client) -> list:
    return client.search_runs(
        ["0", *[e.experiment_id for e in client.search_experiments()]], "tags.dispatch = 'work-pool'"
    )


def _children(client, parent) -> dict:
    runs = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    return {r.info.run_name: r for r in runs}


def _when(iso: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(iso.replace("Z", "+00:00"))


def _stage_flow_runs(stack, parent_run_id: str) -> list[dict]:
    """The heavy stages' flow runs of one pipeline run, as the Prefect server recorded them: stage, start and end
    (whole flow runs on the worker: process start, inputs pulled, the stage, outputs pushed)."""
    runs = stack.prefect_post("/flow_runs/filter", {"limit": 200}, timeout=30)
    return [
        {"stage": r["parameters"]["stage"], "start_time": _when(r["start_time"]), "end_time": _when(r["end_time"])}
        for r in runs
        if r["parameters"].get("parent_run_id") == parent_run_id and r["parameters"].get("stage") in HEAVY
    ]


def test_two_runs_across_two_workers_and_a_restore_in_a_third_clone(stack):
    import mlflow

    from rlhfops.stages import STAGE_NAMES

    runs = [_team_run(stack, f"seed={seed}") for seed in (1, 2)]
    outs = [p.communicate(timeout=1500)[0] for p in runs]
    for p, out in zip(runs, outs):
        assert p.returncode == 0, out[-5000:]
    client = mlflow.MlflowClient(stack.mlflow_url)
    parents = _parents(client)
    assert len(parents) == 2 and all(r.info.status == "FINISHED" for r in parents)
    assert all(r.info.artifact_uri.startswith("mlflow-artifacts:") for r in parents)  # proxied to S3

    spans = []  # (start, end, worker, parent) of each heavy stage run
    for parent in parents:
        children = _children(client, parent)
        lock = yaml.safe_load(
            Path(client.download_artifacts(parent.info.run_id, "dvc.lock", str(stack.root))).read_text()
        )
        assert list(lock["stages"]) == STAGE_NAMES and set(children) <= set(STAGE_NAMES)
        md5s: dict[str, set] = {}
        for entry in lock["stages"].values():
            for item in entry.get("deps", []) + entry.get("outs", []):
                if "md5" in item:
                    md5s.setdefault(item["path"], set()).add(item["md5"])
        assert md5s and all(len(v) == 1 for v in md5s.values()), {p: v for p, v in md5s.items() if len(v) > 1}
        tags = parent.data.tags
        stage_runs = _stage_flow_runs(stack, parent.info.run_id)
        assert {r["stage"] for r in stage_runs} >= set(children) & HEAVY, stage_runs
        for run in stage_runs:
            spans.append((run["start_time"], run["end_time"], tags[f"worker.{run['stage']}"], parent.info.run_id))
        assert {tags[f"worker.{s}"] for s in lock["stages"]} <= {"worker-1", "worker-2"}
    # the two runs were served at the same time, by the two workers (each heavy worker takes one stage at a time)
    overlaps = [(a, b) for a in spans for b in spans if a[3] < b[3] and a[2] != b[2] and a[0] < b[1] and b[0] < a[1]]
    assert overlaps, sorted(spans)

    # a third clone, wired to the stack, restores the first run by its MLflow id
    third = stack.clone(stack.root / "third")
    run_id = parents[0].info.run_id
    done = subprocess.run(
        [sys.executable, "-m", "flows.restore", run_id],
        cwd=third, env=_env(stack, third), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    assert "MISMATCH" not in done.stdout and (third / "models/policy/config.json").is_file()


def _hanging_ppo_run(stack, client):
    """A run whose ppo stage hangs (tests.fixtures.prompt_length_reward while the marker exists), once its ppo
    stage run is RUNNING: (process, parent run, ppo run, the DVC bucket's keys then)."""
    before = {r.info.run_id for r in _parents(client)}
    stack.hang_marker.touch()
    run = _team_run(stack, "seed=1", "ppo.reward_fn=tests.fixtures:prompt_length_reward")
    deadline, ppo, new = time.monotonic() + 900, None, []
    while ppo is None and time.monotonic() < deadline and run.poll() is None:
        time.sleep(2)
        new = [r for r in _parents(client) if r.info.run_id not in before]
        ppo = _children(client, new[0]).get("ppo") if new else None
    assert ppo is not None, "the ppo stage never started"
    objects = {o["Key"] for o in stack.s3_client().list_objects_v2(Bucket="dvc").get("Contents", [])}
    return run, new[0], ppo, objects


def _check_failed_and_nothing_left(stack, client, run, parent, ppo, objects, *words: str) -> None:
    out = run.communicate(timeout=600)[0]
    assert run.returncode == 1, out[-4000:]
    parent = client.get_run(parent.info.run_id)
    worker = parent.data.tags["worker.ppo"]
    for text in (f"stage ppo on worker {worker}", *words):
        assert text in out, (text, out[-4000:])
    assert parent.info.status == "FAILED"
    assert {o["Key"] for o in stack.s3_client().list_objects_v2(Bucket="dvc").get("Contents", [])} == objects
    assert not client.search_model_versions(f"run_id = '{ppo.info.run_id}'")
    assert "stages/ppo.lock.yaml" not in [a.path for a in client.list_artifacts(parent.info.run_id, "stages")]


def test_a_stage_killed_on_its_worker_fails_the_run_naming_both_and_leaves_nothing(stack):
    import mlflow
    import psutil
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    client = mlflow.MlflowClient(stack.mlflow_url)
    run, parent, ppo, objects = _hanging_ppo_run(stack, client)
    try:
        with temporary_settings({PREFECT_API_URL: stack.prefect_url}), get_client(sync_client=True) as prefect:
            victims = []
            for proc in psutil.process_iter():
                try:
                    flow_run_id = proc.environ().get("PREFECT__FLOW_RUN_ID")
                except psutil.Error:
                    continue
                if flow_run_id and prefect.read_flow_run(flow_run_id).parameters.get("stage") == "ppo":
                    victims.append(proc)
        assert victims, "no process runs the ppo stage"
        for proc in victims:
            proc.kill()
        _check_failed_and_nothing_left(stack, client, run, parent, ppo, objects, "Crashed")
        # the killed stage's training slot on its worker comes back once its lease (flows.team.SLOT_LEASE_S) expires
        from flows.pipeline import TRAINING_LIMIT
        from flows.team import SLOT_LEASE_S

        limit = f"{TRAINING_LIMIT}-{client.get_run(parent.info.run_id).data.tags['worker.ppo']}"
        with temporary_settings({PREFECT_API_URL: stack.prefect_url}), get_client(sync_client=True) as prefect:
            deadline = time.monotonic() + SLOT_LEASE_S + 60  # + the server's lease revocation loop (15 s)
            while prefect.read_global_concurrency_limit_by_name(limit).active_slots and time.monotonic() < deadline:
                time.sleep(2)
            assert prefect.read_global_concurrency_limit_by_name(limit).active_slots == 0, limit
    finally:
        stack.hang_marker.unlink()
        if run.poll() is None:
            run.kill()


def test_unreachable_store_and_wrong_credentials_fail_in_preflight(stack, monkeypatch):
    from rlhfops.restore import RemoteUnavailableError, reach_remote
    from rlhfops.stack import free_port

    conf = {"url": "s3://dvc/store", "endpointurl": stack.s3_url}
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", stack.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-key")
    start = time.monotonic()
    with pytest.raises(RemoteUnavailableError, match="refuses the credentials"):
        reach_remote("team", conf)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", stack.secret_key)
    reach_remote("team", conf)
    with pytest.raises(RemoteUnavailableError, match="unreachable"):
        reach_remote("team", {**conf, "endpointurl": f"http://127.0.0.1:{free_port()}"})
    assert time.monotonic() - start < 30


def test_the_compose_file_runs_the_services_the_stack_starts():
    from rlhfops.stack import BUCKETS, DATABASES, QUEUES

    compose = yaml.safe_load((Path(__file__).parent.parent / "docker-compose.yml").read_text())
    services = compose["services"]
    expected = {"postgres", "s3", "buckets", "mlflow", "prefect", "pool"}
    assert set(services) == expected | {f"worker-{i}{s}" for i in (1, 2) for s in ("", "-light")}
    flat = yaml.safe_dump(compose)
    for word in [*BUCKETS, *DATABASES, *QUEUES, "--serve-artifacts", "--artifacts-destination", "-s3.config"]:
        assert word in flat, word


def test_a_worker_killed_mid_stage_fails_the_run_naming_stage_and_worker(stack):
    """The heavy worker running ppo dies with its flow run (a machine lost): its heartbeats stop, the dispatcher
    marks the stage's flow run Crashed and fails the run. Near the end of this module: it leaves one heavy worker."""
    import mlflow
    import psutil

    client = mlflow.MlflowClient(stack.mlflow_url)
    run, parent, ppo, objects = _hanging_ppo_run(stack, client)
    try:
        worker = client.get_run(parent.info.run_id).data.tags["prefect_worker.ppo"]
        proc = psutil.Process(stack.procs.pop(worker).pid)
        for p in [proc, *proc.children(recursive=True)]:
            p.kill()
        _check_failed_and_nothing_left(stack, client, run, parent, ppo, objects, f"Prefect worker {worker} went silent")
    finally:
        stack.hang_marker.unlink()
        if run.poll() is None:
            run.kill()


def test_the_tracking_servers_database_down_fails_in_preflight(stack):
    """Last in this module: it stops the stack's PostgreSQL."""
    from rlhflow.config import load_config
    from rlhfops.tracking import TrackingUnavailableError, preflight

    cfg = load_config(stack.repo / "params.yaml", [f"tracking.tracking_uri={stack.mlflow_url}"])
    preflight(cfg)
    stack.stop_postgres()
    start = time.monotonic()
    with pytest.raises(TrackingUnavailableError, match="backend store failed") as err:
        preflight(cfg)
    assert time.monotonic() - start < 30 and stack.mlflow_url in str(err.value)
