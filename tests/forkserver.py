"""A fork server for the Python processes the tests start: a process that has imported torch, transformers, MLflow,
Great Expectations and the rest (PRELOAD) once, and forks a child for each `python ...` command a test (or
`dvc repro`, through the `python` on its PATH) starts, so that the child runs the command without importing them
again. One server per kind of environment (tests/forkclient.py: IMPORT_ENV) and test process.

The child is a process of its own, as a fresh interpreter's would be: its own pid and process group, the command's
argv, cwd, environment, sys.path and standard streams; it imports the project's modules itself (none is loaded
here). The command's side is tests/forkclient.py, run by the `python` conftest.PYTHON names, standard library only:
it hands the server its argv, cwd, environment and standard streams, forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT to
the child's process group, and exits as the child did (with its code, or killed by its signal). When the client dies
(SIGKILL included), the server SIGKILLs the child's group: a kill test still kills the stage. Commands the server
cannot run as a fresh interpreter would (interpreter options, no server of their kind) run in the real interpreter."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import time
import traceback

from forkclient import import_env

# what the stage and flow commands import (the tiny models' Llama and BERT included), nothing that starts a thread
# (a fork copies none). Not Prefect: it reads its settings (the API's URL) from the environment on import, and they
# differ between a test's commands
PRELOAD = (
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.bert.modeling_bert",
    "transformers.generation",
    "transformers.trainer",
    "peft",
    "datasets",
    "trl",
    "mlflow",
    "mlflow.pyfunc",
    "pandas",
    "great_expectations",
    "scipy.stats",
    "sklearn.linear_model",
    "sklearn.model_selection",
)
MAX_FDS = 3
IDLE_S = 120


def serve(path: str) -> None:
    """Import PRELOAD, then fork a child per request on the unix socket `path` until the socket's file is gone."""
    base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    own_env = import_env(dict(os.environ))  # as the clients saw it, before any import could change it
    os.close(os.pidfd_open(os.getpid()))  # the children are waited for through pidfds (Linux 5.3): none, no server
    for name in PRELOAD:
        importlib.import_module(name)
    # a fork copies no thread: one holding a lock would leave it held in every child. jemalloc's (pyarrow's
    # allocator) takes its locks around a fork; an OpenMP pool (OMP_NUM_THREADS above 1) stops the server
    others = [t for t in os.listdir("/proc/self/task") if int(t) != os.getpid()]
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in others]
    if set(names) - {"jemalloc_bg_thd"}:
        raise RuntimeError(f"the fork server's imports started threads: {names}")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, ("accept", None))
    owner = int(os.environ.get("FORKSERVER_OWNER", os.getppid()))
    last_request = time.monotonic()
    while os.path.exists(path) and _alive(owner):
        events = sel.select(timeout=1.0)
        if events:
            last_request = time.monotonic()
        elif time.monotonic() - last_request > IDLE_S and len(sel.get_map()) == 1:
            break  # no command for a while and none running: its memory back
        # a client gone first: its child is killed before a request that followed the kill starts
        for key, _ in sorted(events, key=lambda e: {"gone": 0, "exit": 1, "accept": 2}[e[0].data[0]]):
            what, child = key.data
            if what == "accept":
                conn, _ = listener.accept()
                started = _start(conn, listener, base_path, own_env)
                if started is None:
                    conn.close()
                    continue
                child = {"pid": started[0], "pidfd": started[1], "conn": conn}
                sel.register(child["pidfd"], selectors.EVENT_READ, ("exit", child))
                sel.register(conn, selectors.EVENT_READ, ("gone", child))
            elif what == "gone":  # the client sends nothing after its request: readable means it is gone
                for kill in (os.killpg, os.kill):  # the group, and the child should it not lead one yet
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        kill(child["pid"], signal.SIGKILL)
                sel.unregister(child["conn"])
                child["conn"].close()
                child["conn"] = None
            elif what == "exit":
                sel.unregister(child["pidfd"])
                os.close(child["pidfd"])
                _, status = os.waitpid(child["pid"], 0)
                if child["conn"] is not None:
                    sel.unregister(child["conn"])
                    with contextlib.suppress(OSError):
                        child["conn"].send(json.dumps({"status": status}).encode())
                    child["conn"].close()
    for key in list(sel.get_map().values()):  # the test process is gone: so are the commands it started
        if key.data[0] == "exit":
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(key.data[1]["pid"], signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _start(conn: socket.socket, listener: socket.socket, base_path: list[str], own_env: dict) -> tuple[int, int] | None:
    """Fork the child for the request on `conn`; returns (pid, pidfd), or None where the request is refused."""
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 22, MAX_FDS)
    try:
        request = json.loads(msg)
    except ValueError:
        request = None
    differs = request is not None and sorted(set(import_env(request["env"]).items()) ^ set(own_env.items()))
    if request is None or differs:
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.send(json.dumps({"refused": str(differs)[:300]}).encode())
        return None
    pid = os.fork()
    if pid == 0:
        listener.close()
        conn.close()
        os._exit(_child(request, fds, base_path))
    with contextlib.suppress(OSError):  # its own group from now on, whichever of the two gets there first
        os.setpgid(pid, pid)
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    try:
        conn.send(json.dumps({"pid": pid}).encode())
    except OSError:  # the client is gone already: so is its command
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(pidfd)
        return None
    return pid, pidfd


def _child(request: dict, fds: list[int], base_path: list[str]) -> int:
    """Become the command's interpreter and run it; returns its exit code."""
    os.setpgid(0, 0)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8", errors="strict")
    sys.stdout = _output(1, unbuffered, line_buffering=os.isatty(1), errors="strict")
    sys.stderr = _output(2, unbuffered, line_buffering=True, errors="backslashreplace")
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    kind, target, args = request["run"]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = os.getcwd() if kind == "module" else "" if kind == "code" else os.path.dirname(os.path.abspath(target))
    sys.path[:] = [first, *extra, *base_path]
    code = 0
    try:
        if kind == "module":
            sys.argv = ["-m", *args]  # runpy puts the module's file first
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "code":
            sys.argv = ["-c", *args]
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = [target, *args]
            runpy.run_path(target, run_name="__main__")
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    return _shutdown(code)


def _output(fd: int, unbuffered: bool, **text) -> io.TextIOWrapper:
    """A standard output stream on `fd`, buffered as a fresh interpreter buffers it (PYTHONUNBUFFERED: not)."""
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(
        raw if unbuffered else io.BufferedWriter(raw), encoding="utf-8", write_through=unbuffered, **text
    )


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


def _shutdown(code: int) -> int:
    """What an interpreter does on exit: atexit handlers, then flushing the standard streams."""
    import atexit
    import threading

    try:
        threading._shutdown()  # non-daemon threads are waited for, as at an interpreter's exit
    except BaseException:
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


if __name__ == "__main__":
    try:
        serve(sys.argv[1])
    finally:
        for suffix in ("", ".starting"):  # (".seen" stays: the kind's next command starts a server again)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(sys.argv[1] + suffix)
