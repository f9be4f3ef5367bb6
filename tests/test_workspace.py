"""One pipeline run at a time per workspace (rlhfops/workspace.py): a second run waits for the first, or (a stage
under `dvc repro`) stops at once naming it; the hold ends with its process, even on SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from rlhfops import workspace

HOLD = """
import sys, time
from pathlib import Path
from rlhfops import workspace
with workspace.exclusive("pipeline flow run 'calm-otter'", root=Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def hold_in_another_process(root, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(root), str(seconds)], stdout=subprocess.PIPE, text=True, env=os.environ
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.system
def test_a_second_run_stops_at_once_naming_the_first(tmp_path):
    proc = hold_in_another_process(tmp_path, 60)
    try:
        with pytest.raises(workspace.WorkspaceBusy, match=r"in use by pipeline flow run 'calm-otter' \(pid \d+"):
            with workspace.exclusive("stage ppo (dvc repro)", wait=False, root=tmp_path):
                pytest.fail("must not run while another run holds the workspace")
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.system
def test_a_second_run_waits_for_the_first_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(workspace, "POLL_S", 0.1)
    monkeypatch.setattr(workspace, "NOTICE_S", 0.5)
    proc = hold_in_another_process(tmp_path, 1.5)
    said, start = [], time.monotonic()
    with workspace.exclusive("the second run", root=tmp_path, log=said.append):
        waited = time.monotonic() - start  # the first run held it for 1.5 s
        assert workspace.holder(tmp_path)["run"] == "the second run"
    proc.wait()
    assert waited > 1.2
    assert any("the second run: waiting for pipeline flow run 'calm-otter'" in line for line in said), said
    assert any("the workspace is free after" in line for line in said)
    assert workspace.holder(tmp_path) == {}  # nobody holds it now


@pytest.mark.system
def test_a_killed_run_leaves_the_workspace_free(tmp_path):
    proc = hold_in_another_process(tmp_path, 600)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with workspace.exclusive("next", wait=False, root=tmp_path):
        assert workspace.holder(tmp_path)["run"] == "next"


@pytest.mark.system
def test_the_hold_is_reentrant_and_shared_with_child_processes(tmp_path):
    with workspace.exclusive("outer", root=tmp_path):
        with workspace.exclusive("inner", wait=False, root=tmp_path):  # same process: passes through
            pass
        child = subprocess.run(  # e.g. the processes of an `accelerate launch` stage
            [
                sys.executable,
                "-c",
                "import sys; from pathlib import Path; from rlhfops import workspace\n"
                "with workspace.exclusive('child', wait=False, root=Path(sys.argv[1])): print('ran')",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
        )
        assert child.returncode == 0 and child.stdout.strip() == "ran", child.stderr
    assert workspace.HELD_ENV not in os.environ


def test_a_flow_run_waits_while_dvc_holds_its_repository_lock(tmp_path, monkeypatch):
    import zc.lockfile

    monkeypatch.setattr(workspace, "POLL_S", 0.05)
    (tmp_path / ".dvc/tmp").mkdir(parents=True)
    dvc_lock = zc.lockfile.LockFile(str(tmp_path / ".dvc/tmp/lock"))  # as `dvc repro` holds it
    started = []
    thread = threading.Thread(
        target=lambda: workspace.exclusive("flow", root=tmp_path, log=lambda _: None).__enter__() or started.append(1)
    )
    assert workspace.dvc_is_busy(tmp_path)
    time.sleep(0.01)
    thread.start()
    time.sleep(0.5)
    assert not started  # waiting for DVC
    dvc_lock.close()
    thread.join(5)
    assert started
