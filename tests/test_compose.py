"""docker-compose.yml read as data (no Docker engine runs here) and held against `make stack` (rlhfops/stack.py):
the same services, published on 127.0.0.1 only, every secret from the `.env` the user makes (`.env.example` holds
none) with a message naming the variable when one is unset, the Prefect server's auth string, CSRF and CORS
settings, MLflow's allowed hosts, SeaweedFS's identity and loopback ports, and the work pool's restricted job
template. Where compose and `make stack` differ by design, test_where_compose_and_make_stack_differ says how."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlhfops.stack import BUCKETS, DATABASES, QUEUES, Stack
from rlhfops.stack_access import LOCKED_JOB_VARIABLES, prefect_server_security, restricted_job_template, s3_identities

REPO = Path(__file__).resolve().parents[1]
COMPOSE_TEXT = (REPO / "docker-compose.yml").read_text()
COMPOSE = yaml.safe_load(COMPOSE_TEXT)
SERVICES = COMPOSE["services"]
REQUIRED = re.compile(r"\$\{(\w+):\?([^}]*)\}")  # ${VAR:?message}: compose stops with the message when VAR is unset
SECRET_NAME = re.compile(r"PASSWORD|SECRET|AUTH_STRING|ACCESS_KEY", re.IGNORECASE)


def _env(service: str) -> dict[str, str]:
    return {k: str(v) for k, v in SERVICES[service].get("environment", {}).items()}


def _stack() -> Stack:
    """A stack's settings as `make stack` makes them (nothing started), on made-up ports."""
    stack = Stack(Path("/nonexistent"))
    stack.ports.update(postgres=5432, s3=8333, mlflow=5000, prefect=4200, weed_master=9333)
    stack.ports.update(weed_volume=8080, weed_filer=8888)
    return stack


def _option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_the_compose_file_runs_the_services_the_stack_starts():
    expected = {"postgres", "s3", "buckets", "mlflow", "prefect", "pool"}
    assert set(SERVICES) == expected | {f"worker-{i}{s}" for i in (1, 2) for s in ("", "-light")}
    flat = yaml.safe_dump(COMPOSE)
    for word in [*BUCKETS, *DATABASES, *QUEUES, "--serve-artifacts", "--artifacts-destination", "-s3.config"]:
        assert word in flat, word


def test_every_published_port_listens_on_loopback_only():
    published = {name: s["ports"] for name, s in SERVICES.items() if "ports" in s}
    assert set(published) == {"s3", "mlflow", "prefect"}  # PostgreSQL and the workers: the compose network only
    wide = [(name, port) for name, ports in published.items() for port in ports if not port.startswith("127.0.0.1:")]
    assert not wide, wide


def test_every_secret_comes_from_the_env_file_and_an_unset_one_stops_compose_naming_it():
    found = REQUIRED.findall(COMPOSE_TEXT)
    assert found
    for var, message in found:
        assert var in message and ".env" in message, (var, message)
    secret_values = {
        (service, key): value
        for service, spec in SERVICES.items()
        for key, value in _env(service).items()
        if SECRET_NAME.search(key)
    }
    assert secret_values
    constant = {k: v for k, v in secret_values.items() if not REQUIRED.fullmatch(v)}
    assert not constant, f"secrets written into docker-compose.yml: {constant}"
    # .env.example names every variable compose requires and gives none a value
    example = dict(
        line.split("=", 1) for line in (REPO / ".env.example").read_text().splitlines() if line and line[0] != "#"
    )
    assert set(example) == {var for var, _ in found}
    assert not any(example.values()), example
    assert ".env" in (REPO / ".gitignore").read_text().split()


def test_no_key_or_password_is_a_constant_of_the_repository():
    former = "rlhf-stack-" + "secret"  # the S3 secret key the repository used to ship
    shipped = [REPO / "docker-compose.yml", REPO / ".env.example", REPO / "rlhfops" / "stack.py"]
    shipped += sorted((REPO / "configs" / "stack").iterdir()) + sorted((REPO / "docs").glob("*.md"))
    assert not [str(p) for p in shipped if former in p.read_text()]
    assert not (REPO / "configs" / "stack" / "s3.json").exists()  # `make stack` and compose write it at start
    one, two = Stack(Path("a")), Stack(Path("b"))
    for name in ("access_key", "secret_key", "pg_password", "auth_string"):
        assert getattr(one, name) != getattr(two, name), name  # each stack its own


def test_the_prefect_server_settings_are_the_stacks():
    stack = _stack()
    server, client = _env("prefect"), _env("pool")
    expected = prefect_server_security(stack.auth_string, stack.prefect_ui_origin)
    assert set(expected) <= set(server)
    assert (
        server["PREFECT_SERVER_API_CSRF_PROTECTION_ENABLED"] == expected["PREFECT_SERVER_API_CSRF_PROTECTION_ENABLED"]
    )
    # one auth string for the server and every client (the pool, the workers, MLflow's environment)
    auth = server["PREFECT_SERVER_API_AUTH_STRING"]
    assert REQUIRED.fullmatch(auth)
    for service in ("pool", "buckets", "mlflow", "worker-1", "worker-2-light"):
        assert _env(service)["PREFECT_API_AUTH_STRING"] == auth, service
    assert stack.client_env()["PREFECT_API_AUTH_STRING"] == stack.auth_string
    # CORS: the UI's origin, where each serves it (compose: its published address; make stack: its own URL)
    host_port = SERVICES["prefect"]["ports"][0].rsplit(":", 1)[0]
    assert server["PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS"] == f"http://{host_port}"
    assert server["PREFECT_UI_API_URL"] == f"http://{host_port}/api"
    assert expected["PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS"] == stack.prefect_url.removesuffix("/api")
    assert client["PREFECT_API_URL"] == "http://prefect:4200/api"


def test_mlflow_answers_the_host_names_its_clients_use():
    """MLflow >= 3.5 refuses a Host header outside its allowed hosts with 403 (while /health answers): the
    workers' `mlflow:5000` is no default one."""
    from mlflow.server.security_utils import get_default_allowed_hosts, is_allowed_host_header

    command = SERVICES["mlflow"]["command"]
    allowed = _option(command, "--allowed-hosts").split(",")
    clients = _env("worker-1")["MLFLOW_TRACKING_URI"].split("//", 1)[1]
    published = SERVICES["mlflow"]["ports"][0].rsplit(":", 1)[0]
    for host in (clients, published):
        assert is_allowed_host_header(allowed, host), host
    assert not is_allowed_host_header(get_default_allowed_hosts(), clients)
    stack = _stack()
    stack_allowed = _option(stack.mlflow_command(), "--allowed-hosts").split(",")
    assert is_allowed_host_header(stack_allowed, stack.mlflow_url.split("//", 1)[1])
    assert not is_allowed_host_header(stack_allowed, "evil.example:5000")


def test_mlflow_runs_without_its_job_runner_in_both():
    """The GenAI job runner (six processes with MLflow loaded) is off wherever the project starts MLflow's server."""
    from rlhfops.stack_access import MLFLOW_SERVER_ENV

    assert MLFLOW_SERVER_ENV == {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    assert MLFLOW_SERVER_ENV.items() <= _env("mlflow").items()
    assert MLFLOW_SERVER_ENV.items() <= _stack().mlflow_env().items()


def test_postgresql_wants_a_password_in_both():
    env = _env("postgres")
    assert "POSTGRES_HOST_AUTH_METHOD" not in env and "trust" not in yaml.safe_dump(SERVICES["postgres"])
    assert "--auth=scram-sha-256" in env["POSTGRES_INITDB_ARGS"].split()
    assert REQUIRED.fullmatch(env["POSTGRES_PASSWORD"])
    for service in ("mlflow", "prefect"):  # the password from the environment, not in a URL on a command line
        assert _env(service)["PGPASSWORD"] == env["POSTGRES_PASSWORD"], service
    assert ":" not in _option(SERVICES["mlflow"]["command"], "--backend-store-uri").split("@")[0].split("//")[1]
    stack = _stack()
    assert stack.pg_password not in stack.database_url("mlflow", "psycopg")
    assert not [part for part in stack.mlflow_command() if stack.pg_password in part]


def test_seaweedfs_has_the_stacks_identity_and_keeps_its_internal_ports_on_loopback():
    entrypoint, command = SERVICES["s3"]["entrypoint"], SERVICES["s3"]["command"]
    # the config compose writes at start, filled as the shell's printf fills it, is the one the stack writes
    template = re.search(r"printf '([^']*)'", entrypoint[2]).group(1)
    assert json.loads(template % ("AK", "SK")) == s3_identities("AK", "SK")
    assert "umask 077" in entrypoint[2]  # the file holding the key: its owner's only
    assert "-ip.bind=127.0.0.1" in command and "-s3.ip.bind=0.0.0.0" in command
    assert SERVICES["s3"]["ports"] == ["127.0.0.1:8333:8333"]
    assert "-ip.bind=127.0.0.1" in _stack().s3_command(Path("s3.json"))


def _default_process_template() -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "prefect", "work-pool", "get-default-base-job-template", "--type", "process"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


@pytest.mark.system
def test_the_work_pools_job_template_lets_no_flow_run_choose_its_command_or_environment(prefect_server):
    """Prefect's own code on the template both use (`python -m rlhfops.stack pool` in compose, Stack.create_pool
    in `make stack`): job variables naming the command, the environment (whole, or one variable in Prefect's
    dotted form) or the working directory are refused by the schema the server checks, and a worker that got them
    anyway builds the same job as without them (resolved against a temporary server, as a worker does)."""
    from prefect.utilities.schema_tools.validation import ValidationError, validate
    from prefect.workers.process import ProcessJobConfiguration

    assert SERVICES["pool"]["command"] == ["python", "-m", "rlhfops.stack", "pool"]
    template = restricted_job_template(_default_process_template())
    chosen = {"command": "touch /tmp/owned", "env": {"PYTHONPATH": "/tmp/hook"}, "working_dir": "/tmp"}
    assert set(chosen) == set(LOCKED_JOB_VARIABLES)
    chosen["env.PYTHONPATH"] = "/tmp/hook"
    for name, value in chosen.items():
        with pytest.raises(ValidationError, match="Additional properties"):
            validate({name: value}, template["variables"], raise_on_error=True, preprocess=True, ignore_required=False)

    def job(values: dict) -> ProcessJobConfiguration:
        return asyncio.run(ProcessJobConfiguration.from_template_and_values(template, values))

    assert job(chosen).model_dump() == job({}).model_dump()
    assert job({}).command is None and job({}).env == {} and job({}).working_dir is None
    validate({"stream_output": False}, template["variables"], raise_on_error=True, preprocess=True)  # the rest stays


def test_the_workers_reach_mlflow_and_s3_over_the_compose_network_by_its_own_names(monkeypatch):
    """Plain http goes to this machine only, but a compose network's services are reached by name: the workers'
    environment names them (RLHFLOW_PRIVATE_HOSTS), which no params file can; without it the rule refuses them."""
    from rlhfops.tracking import TrackingUnavailableError, check_artifact_location, check_transport

    env = _env("worker-1")
    for name in ("MLFLOW_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", env["AWS_ENDPOINT_URL_S3"])
    monkeypatch.setenv("RLHFLOW_PRIVATE_HOSTS", env["RLHFLOW_PRIVATE_HOSTS"])
    check_transport(env["MLFLOW_TRACKING_URI"])
    check_artifact_location("s3://mlflow/artifacts/1/abc", env["MLFLOW_TRACKING_URI"])
    monkeypatch.delenv("RLHFLOW_PRIVATE_HOSTS")
    with pytest.raises(TrackingUnavailableError, match="http://mlflow:5000 is not https"):
        check_transport(env["MLFLOW_TRACKING_URI"])


def test_where_compose_and_make_stack_differ():
    """What differs by design, each checked so that a change to either side shows here:
    - inside its container a service listens on every interface (the compose network is how the services reach
      each other), and the host publishes it on 127.0.0.1 only; `make stack` binds 127.0.0.1 itself;
    - the secrets: compose reads them from .env (the user makes them once), `make stack` generates them per stack
      (ROOT/secrets.json); the ports: compose's are fixed, `make stack` takes free ones;
    - PostgreSQL's server listens on the compose network (no published port); `make stack`'s on 127.0.0.1."""
    assert _option(SERVICES["prefect"]["command"], "--host") == "0.0.0.0"
    assert _option(SERVICES["mlflow"]["command"], "--host") == "0.0.0.0"
    assert "listen_addresses=*" in SERVICES["postgres"]["command"] and "ports" not in SERVICES["postgres"]
    stack = _stack()
    assert _option(stack.prefect_command(), "--host") == "127.0.0.1"
    assert _option(stack.mlflow_command(), "--host") == "127.0.0.1"
    assert all(
        port.startswith("127.0.0.1:") and port.split(":")[1] == port.split(":")[2]
        for s in SERVICES.values()
        for port in s.get("ports", [])
    )
