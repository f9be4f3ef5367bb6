"""Prefect's temporary server, started one process at a time per Prefect home. Its first start creates and migrates
the home's database; two runs started together on a new home both migrate it and one fails ("database is locked",
then "Timed out while attempting to connect to ephemeral Prefect API server"). A flow's command line therefore
starts the server before its flow, holding an exclusive flock in $PREFECT_HOME while it starts."""

from __future__ import annotations

# A light door: prefect, and Prefect's server app only to start one, are imported inside the function that starts it.
import fcntl
import os

from rlhfops.training_slot import lock_dir, on_a_server

LOCK_NAME = "temporary-server.lock"


def start_temporary_server() -> None:
    """Start this process's temporary Prefect server (the one every flow run in it then talks to), unless the
    process talks to a running server or temporary servers are switched off. Waits while another process of the
    same Prefect home starts its own."""
    from prefect.settings import get_current_settings

    if on_a_server() or not get_current_settings().server.ephemeral.enabled:
        return
    from prefect.server.api.server import SubprocessASGIServer

    path = lock_dir() / LOCK_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released at close, or by the kernel if this process dies
        SubprocessASGIServer().start()
    finally:
        os.close(fd)
