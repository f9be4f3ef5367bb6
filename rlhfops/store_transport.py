"""What the tracking store's clients send, and where: the rule of rlhflow/config/credentials.py applied to what each
client would send by itself, wherever it finds it.

MLflow's client finds credentials in the environment, in ~/.mlflow/credentials and, through requests, in ~/.netrc;
libpq in the URI, $PGPASSWORD and ~/.pgpass; boto3 in the AWS settings. Whether any is present on this machine today
says nothing of what the next request sends, so the rule does not ask: plain http, or a database connection that
is not encrypted, goes to this machine only. The artifact location a tracking server hands back for a run is held to
the same rule before anything is written to it or read from it: a server is trusted with runs, not with where the
machine's credentials and files go next.

Each function returns why a store or location is refused (None: it is not); rlhfops/tracking.py raises.
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy.engine import make_url

from rlhflow.config import credentials
from rlhflow.redaction import redact_url, user_info_removed

# MLflow's client sends these to an http(s) tracking server by itself
TRACKING_CREDENTIALS = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
# libpq's sslmode values that encrypt the connection (prefer and allow fall back to plain text)
ENCRYPTED_SSLMODES = {"require", "verify-ca", "verify-full"}
# where boto3 and MLflow's S3 artifact store read an S3-compatible endpoint (the first set wins)
S3_ENDPOINTS = ("MLFLOW_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
# Host names (comma-separated) that the machine's owner says are reached over a network of this machine's own (a
# compose network's services: mlflow, s3): plain http to them passes as it does to 127.0.0.1. The environment's
# alone, never params': a params file or a Prefect parameter cannot widen it.
PRIVATE_HOSTS = "RLHFLOW_PRIVATE_HOSTS"


def http_store_problem(uri: str) -> str | None:
    """An http(s) tracking URI: read alike by every client, and https, on this machine or on a private host."""
    what = " and ".join(credentials_found(uri))
    return credentials.transport_problem("the tracking URI", uri, what, lifted=_on_private_host(uri))


def _on_private_host(url: str) -> bool:
    listed = {h.strip().lower() for h in os.environ.get(PRIVATE_HOSTS, "").split(",") if h.strip()}
    return credentials.scheme_and_host(url)[1] in listed


def credentials_found(uri: str) -> list[str]:
    """What MLflow's client would send the tracking server as things stand, named (never their values); the runs'
    data always."""
    found = [name for name in TRACKING_CREDENTIALS if os.environ.get(name)]
    if user_info_removed(uri) != uri:
        found.append("the password in the tracking URI")
    home = Path.home()
    for label, path in (
        ("~/.mlflow/credentials", home / ".mlflow" / "credentials"),
        ("~/.netrc", Path(os.environ.get("NETRC") or home / ".netrc")),
    ):
        if path.is_file():
            found.append(label)
    return [*found, "every run's params, metrics and models"]


def database_store_problem(uri: str) -> str | None:
    """A database tracking URI other than sqlite: on this machine, or PostgreSQL with an encrypting sslmode."""
    url = make_url(uri)
    backend = url.get_backend_name()
    if backend == "sqlite":
        return None
    hosts = _database_hosts(url, backend)
    elsewhere = [h for h in hosts if not (h.startswith("/") or credentials.is_loopback(h.lower().strip("[]")))]
    if hosts and not elsewhere:
        return None
    where = ", ".join(elsewhere) or "a host of a libpq service file"
    shown = redact_url(uri)
    if backend == "postgresql":
        mode = _query_values(url, "sslmode") or [os.environ.get("PGSSLMODE", "prefer")]
        if all(m in ENCRYPTED_SSLMODES for m in mode):
            return None
        return (
            f"the tracking URI {shown} names PostgreSQL at {where} without sslmode=require, verify-ca or verify-full: "
            "libpq would send its password (the URI's, $PGPASSWORD or ~/.pgpass) and every run's data unencrypted. "
            "Add ?sslmode=verify-full to the URI (or set $PGSSLMODE), or use a database on this machine"
        )
    return (
        f"the tracking URI {shown} names a {backend} database at {where}: a database store elsewhere is accepted as "
        "PostgreSQL with sslmode=require, verify-ca or verify-full only, since its credentials and every run's data "
        "would otherwise cross the network unencrypted. Use an https tracking server, or a database on this machine"
    )


def _database_hosts(url, backend: str) -> list[str]:
    """The hosts a database URI connects to: its host, a `host`/`hostaddr` in its query (comma-separated lists
    too); for PostgreSQL without either, $PGHOSTADDR or $PGHOST (none: a local socket, unless a service names one)."""
    hosts = [url.host] if url.host else []
    for key in ("host", "hostaddr", "unix_socket"):
        hosts += [h for value in _query_values(url, key) for h in value.split(",") if h]
    if not hosts and backend == "postgresql":
        named = os.environ.get("PGHOSTADDR") or os.environ.get("PGHOST")
        if named:
            hosts = [h for h in named.split(",") if h]
        elif not (_query_values(url, "service") or os.environ.get("PGSERVICE")):
            hosts = ["/"]  # libpq's default: the local socket
    return hosts


def _query_values(url, key: str) -> list[str]:
    value = url.query.get(key)
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def artifact_location_problem(location: str, tracking_uri: str) -> str | None:
    """Whether what runs log may go to (or be read from) `location`, the artifact URI of a run or model version of
    the store at `tracking_uri`. A store elsewhere names its own address (mlflow-artifacts:, or http(s) on its host)
    or a cloud bucket; a path on this machine only a store on this machine names; plain http and ftp only here; an
    S3 bucket only through an endpoint that follows the same rule."""
    scheme, host = credentials.scheme_and_host(location)
    store_scheme, store_host = credentials.scheme_and_host(tracking_uri)
    remote_store = store_scheme in ("http", "https") and not credentials.is_loopback(store_host)
    shown = f"the artifact location {redact_url(location)} of the tracking store {redact_url(tracking_uri)}"
    if scheme in ("", "file") or len(scheme) == 1:  # a path (a drive letter reads as a scheme of one letter)
        if remote_store:
            return (
                f"{shown} is a path on this machine: a tracking server elsewhere may not choose where the pipeline "
                "writes. Start the server with --serve-artifacts (clients log through it), or use a bucket"
            )
        return None
    if scheme in ("mlflow-artifacts", "http", "https") and host and host != store_host:
        return f"{shown} is on another host ({host}): MLflow would send it the tracking store's credentials"
    if scheme in ("http", "https", "ftp"):
        return credentials.transport_problem(shown, location, "the tracking store's credentials and the artifacts")
    if scheme in ("s3", "s3a", "s3n"):
        return s3_endpoint_problem()
    return None


def s3_endpoint_problem() -> str | None:
    """The S3-compatible endpoint boto3 would use (AWS's own, https, when none is set) follows the rule."""
    for name in S3_ENDPOINTS:
        endpoint = os.environ.get(name)
        if endpoint:
            what = "requests signed with the AWS key and the artifacts"
            return credentials.transport_problem(f"${name}", endpoint, what, lifted=_on_private_host(endpoint))
    return None
