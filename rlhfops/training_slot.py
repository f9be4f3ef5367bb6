"""The training slot: at most N stages on the accelerator at once, across the workspaces of one machine and the
machines that share a Prefect server (docs/prefect.md#the-training-slot).

- Every run holds one of N lock files, `$PREFECT_HOME/locks/<limit>.<i>.lock`, with an exclusive `flock` (N: the
  slots of the Prefect global concurrency limit `<limit>`); the kernel frees it however the process ends.
- Against a Prefect server (PREFECT_API_URL set) a run also holds a slot of that limit, so machines sharing the
  server wait for each other; the server takes a killed run's slot back when its lease expires.
- On Prefect's temporary server (`make run`, `dvc repro`) the lock file alone: that server never revokes a lease,
  so a slot a killed run held would stay taken.
"""

from __future__ import annotations

# A light door: prefect is imported inside the functions that talk to it, so --help answers before it loads.
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from rlhfops.locks import read_holder, try_flock, write_holder

# Stages that load models on the accelerator (Stage.accelerator) hold one slot of this Prefect global concurrency
# limit (flows/pipeline_flow.py creates it).
TRAINING_LIMIT = "rlhf-training"
NOTICE_S = 600.0  # while waiting, say so this often
POLL_S = 1.0


def on_a_server() -> bool:
    """Whether this process talks to a running Prefect server rather than starting a temporary one."""
    from prefect.settings import get_current_settings

    return bool(get_current_settings().api.url)


def lock_dir() -> Path:
    from prefect.settings import get_current_settings

    return Path(get_current_settings().home).expanduser() / "locks"


def _try_one_of(paths: list[Path], holder: dict) -> int | None:
    """The descriptor of the first of `paths` this process could flock (with `holder` written in it), else None."""
    for path in paths:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if try_flock(fd):
            write_holder(fd, holder)
            return fd
        os.close(fd)
    return None


def _holders(paths: list[Path]) -> str:
    """Who holds the lock files, as they say: 'ppo (pid 123, since 12:00:01)', ..."""
    said = [f"{h['stage']} (pid {h['pid']}, since {h['since']})" for h in map(read_holder, paths) if "stage" in h]
    return ", ".join(said) or "another pipeline run"


@contextlib.contextmanager
def local_slot(stage: str, limit: str, slots: int, log=print) -> Iterator[None]:
    """Hold one of the `slots` lock files of `limit` on this machine while the block runs; say every NOTICE_S of
    waiting who holds them."""
    directory = lock_dir()
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"{limit}.{i}.lock" for i in range(slots)]
    holder = {"stage": stage, "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    started, noticed = time.monotonic(), 0.0
    while (fd := _try_one_of(paths, holder)) is None:
        waited = time.monotonic() - started
        if waited - noticed >= NOTICE_S:
            held_by = _holders(paths)
            log(f"{stage}: waited {waited / 60:.0f} min for a slot of {limit!r} on this machine, held by {held_by}")
            noticed = waited
        time.sleep(POLL_S)
    try:
        yield
    finally:
        write_holder(fd, {})
        os.close(fd)  # releases the flock


@contextlib.contextmanager
def server_slot(stage: str, limit: str, lease_s: float, log=print) -> Iterator[None]:
    """Hold one slot of the Prefect server's global concurrency limit `limit`; say every NOTICE_S of waiting how to
    free a slot that a killed run left taken before its lease expires."""
    from prefect.concurrency.sync import concurrency

    from rlhfops.prefect_replies import bound_prefect_replies

    bound_prefect_replies()  # a stage process talks to the server here alone
    waited = 0.0
    slot = contextlib.ExitStack()  # entered apart from the stage, so a TimeoutError from the stage is not caught
    while True:
        try:
            slot.enter_context(
                concurrency(limit, occupy=1, strict=True, timeout_seconds=NOTICE_S, lease_duration=lease_s)
            )
            break
        except TimeoutError:
            waited += NOTICE_S
            log(
                f"{stage}: waited {waited / 60:.0f} min for a slot of the Prefect concurrency limit {limit!r}, held "
                "by another pipeline run. If no other run is active, a killed run left it taken: free it with "
                "`python -m flows.pipeline --reset-training-limit`."
            )
    with slot:
        yield


@contextlib.contextmanager
def training_slot(stage: str, limit: str, slots: int, lease_s: float = 300.0, log=print) -> Iterator[None]:
    """Hold a slot of `limit` (`slots` of them: its Prefect limit's, as ensure_training_limit read it) while `stage`
    runs: the lock file on this machine, then, against a Prefect server, the server's slot too (the order keeps a
    run from holding a server slot while it waits for this machine)."""
    with local_slot(stage, limit, slots, log):
        if on_a_server():
            with server_slot(stage, limit, lease_s, log):
                yield
        else:
            yield


def reset_server_limit(limit: str) -> tuple[int, int]:
    """Mark every slot of the server's limit `limit` free (a killed run left one taken); returns (slots taken
    before, after)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate

    from rlhfops.prefect_replies import bound_prefect_replies

    bound_prefect_replies()
    with get_client(sync_client=True) as client:
        before = client.read_global_concurrency_limit_by_name(limit).active_slots
        client.update_global_concurrency_limit(limit, GlobalConcurrencyLimitUpdate(active_slots=0))
        return before, client.read_global_concurrency_limit_by_name(limit).active_slots
