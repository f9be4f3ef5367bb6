"""Who can use a team's stack (rlhfops/stack.py, docker-compose.yml, `make ui`'s Prefect server): its owner, who
holds its secrets. The settings and files that keep it so, shared by `make stack`, compose and `make ui`."""

from __future__ import annotations

import json
import os
import pwd
import re
import secrets
import shlex
import stat
import sys
from pathlib import Path

PREFECT_USER = "rlhf"  # the user part of the Prefect API auth string (`user:password`, HTTP basic auth)
# job variables the work pool refuses: a flow run that chose them would run any command, with any environment, or
# from a directory of its choosing (`python -m` imports from the working directory first)
LOCKED_JOB_VARIABLES = ("command", "env", "working_dir")


# MLflow 3's server starts a job runner beside itself for GenAI jobs (trace roll-ups, prompt optimisation) that the
# pipeline never submits: six huey consumers, each a Python process with MLflow loaded. Without them a server answers
# in less than half the time and holds about 2 GB less (docs/testing.md). Where a command passes the user's
# environment on (`make ui`, the tests' servers), the user's own value wins; the stack sets its servers' environment.
MLFLOW_SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def mlflow_server_command(store_uri: str, host: str, port: int, artifacts: Path | None = None) -> list[str]:
    """`mlflow server` over the tracking store `store_uri` as `make ui` starts it: one worker, without
    authentication, serving `artifacts` (a sqlite store's: rlhfops.tracking.sqlite_artifact_root) when given. Run it
    with MLFLOW_SERVER_ENV."""
    command = [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", store_uri]
    command += ["--host", host, "--port", str(port), "--workers", "1"]
    if artifacts is not None:
        command += ["--default-artifact-root", artifacts.as_uri(), "--artifacts-destination", artifacts.as_uri()]
    return command


# The umask of a service that keeps secrets or people's data in the files it makes (SeaweedFS, Label Studio):
# each file and directory is its owner's alone from the moment it exists.
PRIVATE_UMASK = 0o077


def private_opener(path: str, flags: int) -> int:
    """An `opener` for open(): the file, if new, is made with mode 0600; never through a symbolic link."""
    return os.open(path, flags | os.O_NOFOLLOW, 0o600)


def write_private(path: Path, text: str) -> Path:
    """Write `text` to `path`, readable by its owner only from the moment the file exists (created with mode 0600;
    an existing file is narrowed to 0600 before anything is written to it)."""
    with open(path, "w", opener=private_opener) as out:
        os.fchmod(out.fileno(), 0o600)
        out.write(text)
    return path


def private_dir(path: Path, owner: str | None = None) -> Path:
    """`path` as a directory only its owner can enter. A new one is made with mode 0700 (and handed to `owner`, a
    user name, when given); an existing one is kept only if it is a real directory owned by `owner` (by default this
    process's user), then narrowed to 0700. One that someone else made first at a predictable path is refused, never
    adopted: its maker could read what the stack keeps there."""
    uid = pwd.getpwnam(owner).pw_uid if owner else os.geteuid()
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        found = os.lstat(path)
        if not stat.S_ISDIR(found.st_mode) or found.st_uid != uid:
            kind = "a directory" if stat.S_ISDIR(found.st_mode) else "not a directory"
            raise PermissionError(
                f"{path} exists and is {kind} owned by uid {found.st_uid}, not uid {uid}: the stack keeps its "
                "private state only in a directory it made; remove it or choose another root"
            ) from None
    else:
        if owner:
            os.chown(path, uid, -1)
    os.chmod(path, 0o700, follow_symlinks=False)
    return path


HBA_INCLUDES = ("include", "include_if_exists", "include_dir")


def hba_trust_lines(text: str) -> list[int]:
    """The lines of a pg_hba.conf that let a connection in without a password: `trust` as a record's method, read
    as PostgreSQL reads the file (comments, quotes, backslash continuations, any case), and any `include` (what it
    pulls in is not checked here). 1-based line numbers of where each record starts."""
    found, record, start = [], "", 0
    # PostgreSQL ends a line at "\n" only (str.splitlines also splits at \v, \f, \x85...) and strips "\r"
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if not record:
            start = number
        if line.endswith("\\"):
            record += line[:-1] + " "
            continue
        record += line
        fields = _hba_fields(record)
        record = ""
        if not fields:
            continue
        kind = fields[0].lower()
        # database and user (and the address) come first; "trust" there names a database, user or host
        method_and_options = fields[3:] if kind == "local" else fields[4:]
        if kind in HBA_INCLUDES or any(f.lower() == "trust" for f in method_and_options):
            found.append(start)
    return found


def _hba_fields(record: str) -> list[str]:
    """A pg_hba record's fields as PostgreSQL splits them: at spaces, tabs and carriage returns; only double quotes
    quote (a single quote or a backslash is part of a field); "#" outside quotes starts a comment."""
    lexer = shlex.shlex(record, posix=True)
    lexer.whitespace, lexer.quotes, lexer.escape, lexer.commenters = " \t\r", '"', "", "#"
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError:  # an unbalanced quote: not a record PostgreSQL reads, but not one to trust either
        return re.split(r"[ \t\r]+", record.strip(" \t\r"))


def seaweedfs_security() -> str:
    """SeaweedFS's security.toml with fresh signing keys: writes and reads on the volume servers and on the filer's
    HTTP port then want a token signed with them, which only SeaweedFS's own processes (its S3 gateway among them)
    can make. Without it the filer serves and takes any object on its local port, no key asked."""
    sections = ("jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read")
    return "".join(f'[{name}]\nkey = "{secrets.token_urlsafe(32)}"\n' for name in sections)


def new_auth_string() -> str:
    """A fresh Prefect API auth string, `user:password` with 32 random bytes of password."""
    return f"{PREFECT_USER}:{secrets.token_urlsafe(32)}"


def s3_identities(access_key: str, secret_key: str) -> dict:
    """SeaweedFS's S3 configuration: one identity with this key pair and no anonymous one, so a request without
    the key is refused (docker-compose.yml's `s3` service writes the same)."""
    identity = {
        "name": "rlhf",
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    return {"identities": [identity]}


def prefect_server_security(auth_string: str, ui_origin: str) -> dict[str, str]:
    """The Prefect server's settings that keep its API to the owner: every request carries the auth string, a
    state-changing request also a CSRF token (Prefect's clients fetch one), and browsers may call it only from the
    UI's own origin (a web page elsewhere cannot)."""
    return {
        "PREFECT_SERVER_API_AUTH_STRING": auth_string,
        "PREFECT_SERVER_API_CSRF_PROTECTION_ENABLED": "true",
        "PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS": ui_origin,
    }


def restricted_job_template(default: dict) -> dict:
    """A process work pool's base job template (`default`: Prefect's) without the variables LOCKED_JOB_VARIABLES:
    a flow run's job_variables cannot set them (the schema refuses names it does not list), and the job runs the
    worker's own command with the worker's environment."""
    template = json.loads(json.dumps(default))
    variables = template["variables"]
    for name in LOCKED_JOB_VARIABLES:
        variables["properties"].pop(name, None)
        template["job_configuration"].pop(name, None)
    variables["additionalProperties"] = False
    return template
