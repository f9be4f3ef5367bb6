"""An exclusive `flock` that says who holds it: the workspace lock and the training slot's lock files. The kernel
releases a flock when its process ends in any way (SIGKILL and the OOM killer included), so a killed run never
leaves one taken; the holder record written into the file lets a waiting run name whom it waits for."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path


def try_flock(fd: int) -> bool:
    """Take the exclusive flock on `fd` if no other process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def write_holder(fd: int, holder: dict) -> None:
    """Replace what the locked file says of its holder (an empty dict: nobody)."""
    os.ftruncate(fd, 0)
    if holder:
        os.pwrite(fd, json.dumps(holder).encode(), 0)


def read_holder(path: Path) -> dict:
    """Who holds (or last held) the lock file at `path`, as it says; {} when it says nothing readable."""
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
