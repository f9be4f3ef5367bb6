"""The command side of the fork server (tests/forkserver.py): `python` for the commands tests start, standard library
only. It asks the server for its environment's kind to fork a child that runs the command (argv, cwd, environment,
standard streams passed over), forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT to the child's process group, and exits
as the child did. Where the command has interpreter options, or no server of that kind runs yet (it starts one for
the next command), it becomes the real interpreter (exec)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys

# variables the preloaded libraries read on import (thread pools, caches, offline mode, logging): a server holds its
# libraries as imported under one set of them, and serves only commands whose values are the same. Not what they
# read at each call (MLFLOW_TRACKING_URI), nor what DVC sets for each stage (DVC_ROOT), nor Prefect's settings (it is
# not preloaded)
IMPORT_ENV = ("OMP_", "MKL_", "KMP_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "CUDA_")
IMPORT_ENV += ("GX_",)
IMPORT_ENV_NAMES = (
    "HOME",
    "XDG_CACHE_HOME",
    "TOKENIZERS_PARALLELISM",
    "PYTHONHASHSEED",
    "PYTHONWARNINGS",
    "DO_NOT_TRACK",
    "MLFLOW_LOGGING_LEVEL",
    "MLFLOW_CONFIGURE_LOGGING",
)
MAX_SERVERS = 3  # a server holds about 0.7 GB; more kinds than this run in the real interpreter
# files in the working directory a preloaded library reads its settings from on import (Great Expectations' .env)
SETTINGS_FILES = (".env",)
PATH_ENV = "FORKSERVER_DIR"  # the servers' sockets; unset: every command runs in the real interpreter
PYTHON_ENV = "FORKSERVER_PYTHON"  # the real interpreter


def import_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_ENV) or k in IMPORT_ENV_NAMES}


def socket_path(directory: str, env: dict[str, str]) -> str:
    kind = hashlib.sha1(json.dumps(sorted(import_env(env).items())).encode()).hexdigest()[:16]
    return os.path.join(directory, f"{kind}.sock")


def what_to_run(args: list[str]) -> list | None:
    """["module" | "code" | "path", target, argv rest] for `-m mod ...`, `-c code ...` or `script ...`; None for
    any other interpreter option."""
    if not args:
        return None
    if args[0] in ("-m", "-c") and len(args) > 1:
        return ["module" if args[0] == "-m" else "code", args[1], args[2:]]
    if args[0].startswith("-"):
        return None
    return ["path", args[0], args[1:]]


def real_interpreter(args: list[str]) -> None:
    python = os.environ[PYTHON_ENV]
    os.execv(python, [python, *args])


def start_server(path: str) -> None:
    """A server for this environment's kind, started once, by its second command: a kind that comes once (a test's
    own HF_HOME, say) is not worth a server's imports."""
    for mark in (".seen", ".starting"):
        try:
            os.close(os.open(path + mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            break
        except FileExistsError:
            continue
    else:
        return
    directory = os.path.dirname(path)
    if mark == ".seen" or sum(name.endswith(".starting") for name in os.listdir(directory)) > MAX_SERVERS:
        return
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    server = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forkserver.py")
    middle = os.fork()  # the server is the child of a process that exits at once: init's, not the command's
    if middle:
        os.waitpid(middle, 0)
        return
    with open(path + ".log", "ab") as log:
        subprocess.Popen(
            [os.environ[PYTHON_ENV], server, path],
            env=env,
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
    os._exit(0)


def main() -> None:
    args = sys.argv[1:]
    run = what_to_run(args)
    directory = os.environ.get(PATH_ENV)
    if run is None or not directory or any(os.path.exists(name) for name in SETTINGS_FILES):
        real_interpreter(args)
    path = socket_path(directory, dict(os.environ))
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(path)
    except OSError:
        start_server(path)
        real_interpreter(args)
    request = {"run": run, "cwd": os.getcwd(), "env": dict(os.environ)}
    try:  # a closed standard stream cannot be passed on: the real interpreter then
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
        reply = json.loads(conn.recv(1 << 16) or b'{"refused": "no answer"}')
    except OSError:
        reply = {}
    if "pid" not in reply:
        conn.close()
        real_interpreter(args)
    child = reply["pid"]

    def forward(signum, _frame):
        try:
            os.killpg(child, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, forward)
    answer = conn.recv(1 << 16)
    status = json.loads(answer)["status"] if answer else 1 << 8
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    sys.exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main()
