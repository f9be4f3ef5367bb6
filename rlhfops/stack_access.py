"""Who can use a team's stack (rlhfops/stack.py, docker-compose.yml, `make ui`'s Prefect server): its owner, who
holds its secrets. The settings and files that keep it so, shared by `make stack`, compose and `make ui`."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

PREFECT_USER = "rlhf"  # the user part of the Prefect API auth string (`user:password`, HTTP basic auth)
# job variables the work pool refuses: a flow run that chose them would run any command, with any environment, or
# from a directory of its choosing (`python -m` imports from the working directory first)
LOCKED_JOB_VARIABLES = ("command", "env", "working_dir")


def write_private(path: Path, text: str) -> Path:
    """Write `text` to `path`, readable by its owner only from the moment the file exists (created with mode 0600;
    an existing file is narrowed to 0600 before anything is written to it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(fd, 0o600)
        out.write(text)
    return path


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
