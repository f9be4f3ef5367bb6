"""The training slot on one machine: a lock file held with flock, which the kernel frees when its holder dies, so a
run killed with SIGKILL never leaves the next one waiting; with the Prefect temporary server (what `make run`
starts) no slot of its concurrency limit is taken at all, since nothing would ever give it back."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from conftest import REPO

import rlhfops.training_slot as slot_module
from flows.pipeline import TRAINING_LIMIT

HOLD = (
    "import sys, time, rlhfops.training_slot as s\n"
    "with s.local_slot('ppo', sys.argv[1], int(sys.argv[2])):\n"
    "    print('held', flush=True)\n"
    "    time.sleep(600)\n"
)


@contextlib.contextmanager
def _holder(code: str, *args: str, env: dict | None = None) -> Iterator[subprocess.Popen]:
    """A process that takes a slot, says 'held' and keeps it until killed; its process group (a temporary Prefect
    server it started included) is killed at the end."""
    proc = subprocess.Popen(
        [sys.executable, "-u", "-c", code, *args],
        cwd=REPO,
        # this process's Prefect home, whatever earlier tests left in the environment: the same lock files
        env=env or {**os.environ, "PREFECT_HOME": str(slot_module.lock_dir().parent)},
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    said = []  # what it says first (Prefect's temporary server announces itself)
    while not said or said[-1] not in ("held\n", ""):
        said.append(proc.stdout.readline())
    try:
        assert said[-1] == "held\n", "".join(said)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.mark.timeout(120)  # a slot a killed holder kept would leave this test waiting for good
@pytest.mark.system
def test_a_waiting_stage_names_the_holder_and_enters_once_the_holder_is_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(slot_module, "NOTICE_S", 0.2)
    monkeypatch.setattr(slot_module, "POLL_S", 0.05)
    limit = f"{TRAINING_LIMIT}-{tmp_path.name}"  # this test's own lock files, in the suite's Prefect home
    said: list[str] = []
    killed: list[float] = []
    with _holder(HOLD, limit, "1") as holder:

        def log(line: str) -> None:
            said.append(line)
            if len(said) == 2:  # waited past two notices: the holder dies as an OOM kill would end it
                holder.send_signal(signal.SIGKILL)
                killed.append(time.monotonic())

        with slot_module.local_slot("sft", limit, 1, log=log):
            entered = time.monotonic()
    assert len(said) == 2 and all(f"held by ppo (pid {holder.pid}, since " in line for line in said), said
    assert said[0].startswith(f"sft: waited 0 min for a slot of {limit!r} on this machine"), said
    assert killed and entered > killed[0]  # it waited for the holder, whose slot was free once it was killed


@pytest.mark.timeout(120)
@pytest.mark.system
def test_two_slots_let_two_stages_in_and_a_third_waits(tmp_path, monkeypatch):
    monkeypatch.setattr(slot_module, "NOTICE_S", 0.1)
    monkeypatch.setattr(slot_module, "POLL_S", 0.05)
    limit = f"{TRAINING_LIMIT}-{tmp_path.name}"
    said: list[str] = []
    with _holder(HOLD, limit, "2") as first, _holder(HOLD, limit, "2") as second:  # both said 'held': both in

        def log(line: str) -> None:
            said.append(line)
            second.terminate()  # SIGTERM: the holder ends without leaving its `with`, the kernel frees its lock

        with slot_module.local_slot("evaluate", limit, 2, log=log):
            pass
    assert len(said) == 1 and f"pid {first.pid}" in said[0] and f"pid {second.pid}" in said[0], said
    assert sorted(p.name for p in slot_module.lock_dir().glob(f"{limit}.*")) == [f"{limit}.0.lock", f"{limit}.1.lock"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.system
def test_a_run_killed_holding_the_slot_on_the_temporary_server_leaves_nothing_taken(tmp_path):
    """What `make run` does: no PREFECT_API_URL, so each process starts Prefect's temporary server on the shared
    database. A stage killed with SIGKILL inside its slot; the next one enters at once, and the concurrency limit
    in the database has no slot taken (the temporary server would never give one back)."""
    code = (
        "import time\n"
        "from flows.pipeline import TRAINING_LIMIT, ensure_training_limit\n"
        "from rlhfops.training_slot import training_slot\n"
        "slots = ensure_training_limit.fn()\n"
        "with training_slot('ppo', TRAINING_LIMIT, slots):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(600)\n"
    )
    env = {**os.environ, "PREFECT_HOME": str(tmp_path)}  # its own database and locks, as a user's ~/.prefect
    with _holder(code, env=env) as first:
        first.send_signal(signal.SIGKILL)  # the run alone, as the OOM killer ends it; its server lives on
        first.wait(timeout=30)
        with _holder(code, env=env):  # 'held' again: the killed run's slot is free
            pass
    check = (
        "from prefect.client.orchestration import get_client\n"
        "with get_client(sync_client=True) as c:\n"
        f"    print(c.read_global_concurrency_limit_by_name({TRAINING_LIMIT!r}).active_slots)\n"
    )
    out = subprocess.run([sys.executable, "-c", check], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "0", out.stdout + out.stderr
