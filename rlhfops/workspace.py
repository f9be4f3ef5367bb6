"""One pipeline run at a time per workspace (docs/prefect.md).

A run's stages read and write fixed paths of the workspace (data/validated, models/..., metrics/, dvc.lock), so a
pipeline run holds the workspace for its whole length: an exclusive `flock` on `.dvc/tmp/rlhflow-run.lock` under the
repository root, freed by the kernel however the process ends. A second flow run (CLI, Prefect UI, a sweep) waits,
naming the run it waits for; so does one started while `dvc repro` holds DVC's lock. A stage's CLI holds the
workspace for the stage; under `dvc repro` it does not wait but stops at once, naming the holder. Runs meant to go
side by side use workspaces of their own: `dvc exp run --temp` / `--queue` (copies under .dvc/tmp/exps/, logging to
the project's MLflow store), or a clone per Prefect worker (docs/scaling.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import zc.lockfile

from rlhflow.config.params import REPO_ROOT
from rlhfops.locks import read_holder, try_flock, write_holder

LOCK_PATH = Path(".dvc") / "tmp" / "rlhflow-run.lock"
# set in the environment of a process (and its children) while it holds the workspace
HELD_ENV = "RLHFLOW_WORKSPACE_HELD"
NOTICE_S = 300.0  # while waiting, say so this often
POLL_S = 2.0


class WorkspaceBusy(RuntimeError):
    """Another run holds the workspace."""


def lock_path(root: Path = REPO_ROOT) -> Path:
    return root / LOCK_PATH


def holder(root: Path = REPO_ROOT) -> dict:
    """Who holds (or last held) the workspace: what its lock file says."""
    return read_holder(lock_path(root))


def describe(owner: dict) -> str:
    if not owner:
        return "another run"
    return f"{owner.get('run', 'a run')} (pid {owner.get('pid')} on {owner.get('host')}, since {owner.get('since')})"


def dvc_is_busy(root: Path = REPO_ROOT) -> bool:
    """Whether another process holds DVC's repository lock (`dvc repro`, `dvc exp run` in this workspace)."""

    path = root / ".dvc" / "tmp" / "lock"
    if not path.parent.is_dir():
        return False
    try:
        zc.lockfile.LockFile(str(path)).close()
    except zc.lockfile.LockError:
        return True
    return False


@contextlib.contextmanager
def exclusive(run: str, *, wait: bool = True, root: Path = REPO_ROOT, log=print) -> Iterator[None]:
    """Hold the workspace while the block runs. `run` names this run in the messages others see. With `wait`, wait
    for the run that holds it and for a DVC command holding DVC's lock, saying so every NOTICE_S; without (a stage
    that DVC runs, under DVC's own lock), raise WorkspaceBusy at once. Re-entrant: a process (or a child of one)
    that holds the workspace passes through."""
    if os.environ.get(HELD_ENV) == str(root):
        yield
        return
    path = lock_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        started, noticed = time.monotonic(), -NOTICE_S
        while True:
            if try_flock(fd):
                if not (wait and dvc_is_busy(root)):
                    break
                fcntl.flock(fd, fcntl.LOCK_UN)  # free, but a DVC command works in it: wait for that
                busy = "a DVC command (dvc repro?) holding DVC's lock"
            else:  # a run holds it (and may itself hold DVC's lock a moment): name the run
                busy = describe(holder(root))
            if not wait:
                raise WorkspaceBusy(
                    f"this workspace ({root}) is in use by {busy}: one pipeline run at a time per workspace. Start "
                    "this one when that has finished, or run it apart with `dvc exp run --temp` (docs/prefect.md)"
                )
            waited = time.monotonic() - started
            if waited - noticed >= NOTICE_S:
                log(f"{run}: waiting for {busy} to finish with this workspace ({waited / 60:.0f} min so far)")
                noticed = waited
            time.sleep(POLL_S)
        waited = time.monotonic() - started
        if waited > POLL_S:
            log(f"{run}: the workspace is free after {waited / 60:.1f} min; starting")
        owner = {
            "run": run,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        write_holder(fd, owner)
        os.environ[HELD_ENV] = str(root)
        try:
            yield
        finally:
            os.environ.pop(HELD_ENV, None)
            write_holder(fd, {})
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
