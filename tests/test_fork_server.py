"""The suite's fork server (tests/forkserver.py, tests/forkclient.py): a command run through it is a process of its own
as a fresh interpreter's would be: its argv, cwd, environment, sys.path, standard streams, exit status and death by
a signal, and a SIGKILL of its client kills it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import PYTHON

pytestmark = pytest.mark.system

REPORT = """
import json, os, sys
report = {"argv": sys.argv, "cwd": os.getcwd(), "x": os.environ.get("FORK_TEST"), "path0": sys.path[0]}
report.update(pid=os.getpid(), pgid=os.getpgid(0), stdin=sys.stdin.read(), torch="torch" in sys.modules)
print(json.dumps(report))
sys.stderr.write("to stderr\\n")
sys.exit(int(sys.argv[1]))
"""


def forked_run(code: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-c", code, *args], capture_output=True, text=True, timeout=120, **kwargs)


def sleeping_command() -> tuple[subprocess.Popen, int]:
    """A forked command that sleeps, and its pid (which it prints first)."""
    code = "import os, time; print(os.getpid(), flush=True); time.sleep(300)"
    proc = subprocess.Popen([PYTHON, "-c", code], stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


@pytest.mark.skipif(PYTHON == sys.executable, reason="RLHFLOW_TEST_FORK_SERVER=0")
def test_a_forked_command_is_a_process_of_its_own(tmp_path):
    env = {**os.environ, "FORK_TEST": "yes"}
    forked_run("import torch")  # the first command of its kind: the next one starts the server
    deadline = time.monotonic() + 120
    while True:  # until the server answers (it imports its libraries first)
        done = forked_run(REPORT, "3", "a b", cwd=tmp_path, env=env, input="in")
        report = json.loads(done.stdout)
        if report["torch"] or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert report["torch"], "no command ran in the fork server"
    assert done.returncode == 3 and done.stderr == "to stderr\n"
    assert report["argv"] == ["-c", "3", "a b"] and report["cwd"] == str(tmp_path) and report["x"] == "yes"
    assert report["path0"] == "" and report["stdin"] == "in"
    assert report["pid"] == report["pgid"] != os.getpid()  # a process group of its own

    proc, _ = sleeping_command()
    proc.send_signal(signal.SIGTERM)  # forwarded: the command dies of it, and so does its client
    assert proc.wait(timeout=60) == -signal.SIGTERM

    proc, child = sleeping_command()
    proc.kill()  # the client dies without a word: the server kills the command
    assert proc.wait(timeout=60) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}"), "the command outlived its killed client"


def test_interpreter_options_run_in_the_real_interpreter():
    done = subprocess.run(
        [PYTHON, "-S", "-c", "import sys; print('site' in sys.modules)"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
