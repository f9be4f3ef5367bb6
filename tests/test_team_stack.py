"""The team stack, started for real on 127.0.0.1 (rlhfops/stack.py): PostgreSQL behind the MLflow server and the
Prefect server, SeaweedFS's S3 holding MLflow's artifacts and the DVC remote, two workers in their own clones.
Tiny pipelines started through the Prefect API run their stages across both workers (flows/team.py), two at once;
a third clone restores one by its MLflow id; a stage process killed mid-stage fails its run naming the stage and
the worker, and leaves nothing in the remote or the registry; an unreachable store or wrong credentials fail in
preflight, in seconds. Only the owner gets in: Prefect wants the auth string and a CSRF token, and no flow run
chooses a worker's command or environment; PostgreSQL wants the password, S3 the stack's key; SeaweedFS's
internal ports listen on 127.0.0.1; the secret files are the owner's alone. `make test-stack` (.ci/run calls it)."""

from __future__ import annotations

import base64
import contextlib
import datetime
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import ALLOW_TEST_REWARD, make_dvc_repo

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
        worker_env={**ALLOW_TEST_REWARD, "RLHF_TEST_HANG_WHEN": str(hang), "OMP_NUM_THREADS": "1"},
        keep_data=False,
    ) as s:
        s.hang_marker = hang
        yield s


def _env(stack, clone: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    home = str(stack.root / "client-home")
    return {**env, **stack.client_env(), **ALLOW_TEST_REWARD, "PYTHONPATH": str(clone), "PREFECT_HOME": home}


@contextlib.contextmanager
def _prefect(stack):
    """A Prefect client of the stack, as its workers and clients have one (the auth string included)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    settings = {PREFECT_API_URL: stack.prefect_url, PREFECT_API_AUTH_STRING: stack.auth_string}
    with temporary_settings(settings), get_client(sync_client=True) as client:
        yield client


def _team_run(stack, *overrides: str, stages: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "flows.team", "run"] + [a for o in overrides for a in ("--set", o)]
    cmd += ["--stages", stages] if stages else []
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
    # only the stages ppo reads (judge and sft_answers are not its inputs): their inputs checked out by md5 from the
    # run's own lock entries, as in a whole run
    upstream = "demo_data,validate,sft,reward_model,ppo"
    run = _team_run(stack, "seed=1", "ppo.reward_fn=tests.fixtures:prompt_length_reward", stages=upstream)
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

    client = mlflow.MlflowClient(stack.mlflow_url)
    run, parent, ppo, objects = _hanging_ppo_run(stack, client)
    try:
        with _prefect(stack) as prefect:
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
        with _prefect(stack) as prefect:
            deadline = time.monotonic() + SLOT_LEASE_S + 60  # + the server's lease revocation loop (15 s)
            while prefect.read_global_concurrency_limit_by_name(limit).active_slots and time.monotonic() < deadline:
                time.sleep(2)
            assert prefect.read_global_concurrency_limit_by_name(limit).active_slots == 0, limit
    finally:
        stack.hang_marker.unlink()
        if run.poll() is None:
            run.kill()


# ---- only the owner gets in --------------------------------------------------------------------------------------


def _http_status(url: str, headers: dict[str, str] | None = None, body: dict | None = None) -> int:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def _basic(auth_string: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(auth_string.encode()).decode()}


def test_the_prefect_api_wants_the_auth_string_and_a_csrf_token(stack):
    api, auth = stack.prefect_url, _basic(stack.auth_string)
    assert stack.auth_string.startswith("rlhf:") and len(stack.auth_string) > 40
    assert _http_status(f"{api}/work_pools/rlhf") == 401
    assert _http_status(f"{api}/work_pools/rlhf", _basic("rlhf:guess")) == 401
    assert _http_status(f"{api}/work_pools/rlhf", auth) == 200
    # a state-changing request needs a CSRF token too, and only the auth string gets one
    assert _http_status(f"{api}/flow_runs/filter", body={}) == 403
    assert _http_status(f"{api}/flow_runs/filter", auth, body={}) == 403
    assert _http_status(f"{api}/csrf-token?client=guest") == 401
    assert isinstance(stack.prefect_post("/flow_runs/filter", {"limit": 1}), list)  # both, as Prefect's clients
    with _prefect(stack) as client:  # Prefect's own client fetches its CSRF token
        assert client.read_work_pool("rlhf").name == "rlhf"
    # a browser: only the UI's own origin may call the API
    for origin, allowed in ((stack.prefect_ui_origin, True), ("http://evil.example", False)):
        preflight = urllib.request.Request(
            f"{api}/flow_runs/filter",
            method="OPTIONS",
            headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
        )
        try:
            with urllib.request.urlopen(preflight, timeout=10) as response:
                granted = response.headers.get("access-control-allow-origin")
        except urllib.error.HTTPError as err:
            granted = err.headers.get("access-control-allow-origin")
        assert (granted == origin) is allowed, (origin, granted)


def test_no_flow_run_chooses_what_a_worker_runs(stack, tmp_path):
    """The work pool's job template has no command, env or working_dir: the API refuses a flow run that sets them,
    and a flow run created where Prefect does not check its job variables (POST /flow_runs/) runs the worker's own
    command in the worker's environment: neither the command nor the sitecustomize.py on the PYTHONPATH it asks for
    leaves its marker."""
    pool = stack.prefect_get("/work_pools/rlhf")["base_job_template"]
    assert not {"command", "env", "working_dir"} & set(pool["variables"]["properties"])
    assert not {"command", "env", "working_dir"} & set(pool["job_configuration"])
    deployment = stack.prefect_get("/deployments/name/rlhf-stage-on-worker/light")
    marker, hook = tmp_path / "ran-the-command", tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(f"open({str(tmp_path / 'ran-with-the-env')!r}, 'w').close()\n")
    chosen = {"command": f"touch {marker}", "env": {"PYTHONPATH": str(hook)}, "working_dir": str(tmp_path)}
    chosen["env.PYTHONPATH"] = str(hook)  # one variable, in Prefect's dotted form
    for name, value in chosen.items():
        with pytest.raises(urllib.error.HTTPError) as refused:
            stack.prefect_post(f"/deployments/{deployment['id']}/create_flow_run", {"job_variables": {name: value}})
        assert refused.value.code == 422 and "Additional properties" in refused.value.read().decode(), name
    run = stack.prefect_post(
        "/flow_runs/",
        {
            "flow_id": deployment["flow_id"],
            "deployment_id": deployment["id"],
            "work_pool_name": "rlhf",
            "work_queue_name": "light",
            "state": {"type": "SCHEDULED"},
            "job_variables": chosen,
        },
    )
    deadline, state = time.monotonic() + 240, None
    while time.monotonic() < deadline:
        state = stack.prefect_get(f"/flow_runs/{run['id']}")["state"]["type"]
        if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            break
        time.sleep(2)
    assert state in ("FAILED", "CRASHED", "COMPLETED"), f"no worker ran the flow run: {state}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hook"]  # no marker


def _psql(stack, env: dict[str, str], *prefix: str, host: str = "127.0.0.1") -> subprocess.CompletedProcess:
    cmd = [*prefix, "psql", "-w", "-h", host, "-p", str(stack.ports["postgres"]), "-U", "rlhf", "-d", "postgres"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    return subprocess.run([*cmd, "-tAc", "select 1"], env={**base, **env}, capture_output=True, text=True)


def test_postgresql_wants_the_password_over_tcp_and_its_socket(stack):
    hba = stack.pg_data / "data" / "pg_hba.conf"
    rules = [line.split() for line in hba.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert rules and {rule[-1] for rule in rules} == {"scram-sha-256"}, rules
    none = {"PGPASSFILE": "/dev/null"}
    assert "no password supplied" in _psql(stack, none).stderr
    assert "password authentication failed" in _psql(stack, {**none, "PGPASSWORD": "guess"}).stderr
    # the local socket, as the cluster's owner: a trust cluster let any local user in here
    owner = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    assert _psql(stack, none, *owner, host=str(stack.pg_data)).returncode != 0
    done = _psql(stack, {**none, "PGPASSWORD": stack.pg_password})
    assert done.stdout.strip() == "1", done.stderr


def test_s3_refuses_the_old_key_and_anonymous_requests(stack):
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config as BotoConfig
    from botocore.exceptions import ClientError

    once = {"retries": {"total_max_attempts": 1}}
    old = boto3.session.Session().client(  # the key pair the repository used to ship
        "s3", endpoint_url=stack.s3_url, region_name="us-east-1", config=BotoConfig(**once),
        aws_access_key_id="rlhf", aws_secret_access_key="rlhf-stack-" + "secret",
    )  # fmt: skip
    anonymous = boto3.session.Session().client(
        "s3", endpoint_url=stack.s3_url, region_name="us-east-1", config=BotoConfig(signature_version=UNSIGNED, **once)
    )
    for s3 in (old, anonymous):
        for method, kwargs in (("list_objects_v2", {}), ("put_object", {"Key": "x", "Body": b"x"})):
            with pytest.raises(ClientError) as refused:
                getattr(s3, method)(Bucket="dvc", **kwargs)
            assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] in (401, 403), refused.value
    assert _http_status(f"{stack.s3_url}/dvc") == 403
    assert "Contents" not in stack.s3_client().list_objects_v2(Bucket="dvc", Prefix="x")


def test_seaweedfs_internal_ports_listen_on_loopback_only(stack):
    import psutil

    weed = psutil.Process(stack.procs["s3"].pid)
    listening = {
        (c.laddr.ip, c.laddr.port)
        for p in (weed, *weed.children(recursive=True))
        for c in p.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }
    assert {ip for ip, _ in listening} == {"127.0.0.1"}, listening
    for name in ("weed_master", "weed_volume", "weed_filer", "s3"):
        assert ("127.0.0.1", stack.ports[name]) in listening, name
    # the filer's own HTTP port, where any local user could read or write an object without the S3 key
    stack.s3_client().put_object(Bucket="dvc", Key="private", Body=b"an object")
    filer = f"http://127.0.0.1:{stack.ports['weed_filer']}/buckets/dvc"
    assert _http_status(f"{filer}/private") == 401 and _http_status(f"{filer}/?pretty=y") == 401
    assert _http_status(f"{filer}/planted", body={"x": 1}) == 401  # a POST: an upload
    stack.s3_client().delete_object(Bucket="dvc", Key="private")


def test_the_secret_files_are_the_owners_and_no_command_line_holds_a_secret(stack):
    import psutil

    for name in ("stack.env", "s3.json", "secrets.json"):
        assert (stack.root / name).stat().st_mode & 0o777 == 0o600, name
    for private in (stack.root, stack.root / "s3", stack.pg_data):
        assert private.stat().st_mode & 0o777 == 0o700, private
    stored = [f for f in (stack.root / "s3").rglob("*") if f.suffix in (".dat", ".idx")]  # the objects' files
    assert stored and not [f for f in stored if f.stat().st_mode & 0o077], "a stored file others can read"
    assert not (stack.pg_data / "pwfile").exists()  # initdb's password file lives only while initdb runs
    values = (stack.secret_key, stack.pg_password, stack.auth_string.split(":", 1)[1])
    for proc in stack.procs.values():
        for p in (psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)):
            with contextlib.suppress(psutil.Error):
                assert not any(v in " ".join(p.cmdline()) for v in values), p.cmdline()


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
    from rlhflow.config.params import load_config
    from rlhfops.tracking import TrackingUnavailableError, preflight

    cfg = load_config(stack.repo / "params.yaml", [f"tracking.tracking_uri={stack.mlflow_url}"])
    preflight(cfg)
    stack.stop_postgres()
    start = time.monotonic()
    with pytest.raises(TrackingUnavailableError, match="backend store failed") as err:
        preflight(cfg)
    assert time.monotonic() - start < 30 and stack.mlflow_url in str(err.value)
