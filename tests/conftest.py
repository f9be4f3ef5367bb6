"""Shared fixtures: tiny real models and a tiny-pipeline parameter set, all built locally."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
# the suite's models, data and runs lie in temporary directories outside each test's project: the machine's owner (the
# suite) names them, as a user names a data directory (rlhflow/config/output_paths.py; test_safe_paths.py unsets it)
os.environ["RLHFLOW_ALLOW_PATHS"] = tempfile.gettempdir()
# The suite's own Prefect home (its database, concurrency limits and slot locks), removed at exit: what runs
# outside the suite left in ~/.prefect (a slot a killed run held) must not change a test, nor a test touch it.
# A test that needs a server starts its own; one the user's shell points to is not used.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="rlhflow-tests-prefect-")
atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], ignore_errors=True)
for _name in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "PREFECT_API_KEY"):
    os.environ.pop(_name, None)

CHECKOUT = Path(__file__).resolve().parents[1]  # where the suite was started: screenshots go here
# ignored directories of the checkout that tests use: the labeling tool's venv and the benchmarks' peer venv
LINKED_VENVS = (".venv-label", "bench/.venv-trl")


def project_files(src: Path, *, untracked: bool = True) -> list[str]:
    """The project's files in the working tree at `src`: what git tracks and, with `untracked`, what it does not
    ignore (the files of a `git archive` of a commit of that tree)."""
    listing = ["git", "ls-files", "-z", "--cached"] + (["--others", "--exclude-standard"] if untracked else [])
    names = subprocess.run(listing, cwd=src, capture_output=True, text=True, check=True).stdout.split("\0")
    return [name for name in dict.fromkeys(names) if name and (src / name).is_file() and not (src / name).is_symlink()]


def copy_files(src: Path, dest: Path, names: list[str]) -> None:
    for rel in names:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, dest / rel)


def commit_all(repo: Path, message: str) -> None:
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"]):
        subprocess.run(cmd, cwd=repo, check=True, capture_output=True)
    commit = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message]
    subprocess.run(commit, cwd=repo, check=True, capture_output=True)


def this_process_workspace() -> Path:
    """A copy of the project for this test process, committed in a git repository of its own, with the checkout's
    venvs linked in; removed at exit. The code the tests import, the stage and flow commands they start and the
    workspace their runs hold (rlhfops/workspace.py: one run per workspace) are the copy's, so test processes run
    side by side without waiting for each other, and the checkout keeps no trace of the suite (no dvc.lock, no
    DVC cache, no MLflow store)."""
    dest = Path(tempfile.mkdtemp(prefix="rlhflow-tests-workspace-"))
    atexit.register(shutil.rmtree, dest, ignore_errors=True)
    # not a run record the checkout may hold: the suite's runs start from none
    copy_files(CHECKOUT, dest, [name for name in project_files(CHECKOUT) if name != "dvc.lock"])
    commit_all(dest, "the project as the suite tests it")
    for rel in LINKED_VENVS:
        if (CHECKOUT / rel).is_dir():
            (dest / rel).symlink_to(CHECKOUT / rel, target_is_directory=True)
    return dest


REPO = this_process_workspace()
sys.path.insert(0, str(REPO))  # before the project is first imported: its code is the copy's

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers share the cores: one thread each (and in the stages they start) instead of oversubscribing
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def fork_server_python() -> str:
    """The `python` the stage and flow commands of this test process run as: tests/forkclient.py, whose fork server
    (tests/forkserver.py: PRELOAD) holds torch, transformers, MLflow, Great Expectations and the rest imported, so
    that a command skips their imports (docs/testing.md). A command keeps being a process of its own: its pid,
    process group, environment, exit status and death by a signal. RLHFLOW_TEST_FORK_SERVER=0: the real
    interpreter."""
    if os.environ.get("RLHFLOW_TEST_FORK_SERVER", "1") == "0":
        return sys.executable
    home = Path(tempfile.mkdtemp(prefix="rlhflow-tests-fork-"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)  # each server stops once its socket is gone
    (home / "bin").mkdir()
    shim = home / "bin" / "python"
    here = Path(__file__).resolve().parent
    shim.write_text(
        f"#!{sys.executable} -IS\nimport sys\nsys.path.insert(0, {str(here)!r})\nfrom forkclient import main\nmain()\n"
    )
    shim.chmod(0o755)
    os.environ.update(FORKSERVER_DIR=str(home), FORKSERVER_PYTHON=sys.executable, FORKSERVER_OWNER=str(os.getpid()))
    return str(shim)


PYTHON = fork_server_python()


def forked(cmd) -> list[str]:
    """`cmd` with the project's interpreter replaced by the fork server's `python` (PYTHON)."""
    cmd = list(cmd)
    return [PYTHON, *cmd[1:]] if cmd and cmd[0] == sys.executable else cmd


_PREFECT_API: list[str] = []


def shared_prefect_api() -> str:
    """This test process's Prefect server (its own sqlite database in the suite's Prefect home), started at first
    need and stopped at exit: the flows of every test in the process run on it, in-process (`prefect_server`) or
    as commands (`with_prefect_api`), instead of each flow command starting a temporary server of its own (about
    15 s and 9 CPU-seconds a start). Its API URL."""
    if not _PREFECT_API:
        from prefect.server.api.server import SubprocessASGIServer
        from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL, temporary_settings

        database = Path(os.environ["PREFECT_HOME"]) / f"server-{os.getpid()}.db"
        with temporary_settings({PREFECT_SERVER_DATABASE_CONNECTION_URL: f"sqlite+aiosqlite:///{database}"}):
            server = SubprocessASGIServer(port=free_port())
            server.start(timeout=180)
        atexit.register(server.stop)
        _PREFECT_API.append(server.api_url)
    return _PREFECT_API[0]


def starts_a_flow(cmd: tuple[str, ...] | list[str]) -> bool:
    """Whether `cmd` is `python -m flows.<name> ...`, a flow's command line."""
    return any(a == "-m" and b.startswith("flows.") for a, b in zip(cmd, cmd[1:]))


def with_prefect_api(env: dict[str, str]) -> dict[str, str]:
    """`env` for a flow command: it talks to this test process's Prefect server. Tests where a temporary server's
    start is what they check (test_concurrent_runs, test_quiet_logs, test_training_slot) leave it out."""
    return {**env, "PREFECT_API_URL": shared_prefect_api()}


@pytest.fixture(scope="session")
def prefect_test_api() -> str:
    """The test process's Prefect server (shared_prefect_api) as a fixture."""
    return shared_prefect_api()


@pytest.fixture(scope="module")
def prefect_server(prefect_test_api):
    """The flow runs of one test module go to the test process's Prefect server (prefect_test_api); the module's
    logs are sent before the next module starts."""
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_test_api}):
        yield prefect_test_api
        APILogWorker.drain_all(timeout=30)


# The environment that lets a run's ppo.reward_fn name a test reward (rlhflow/config/code_settings.py).
ALLOW_TEST_REWARD = {"RLHFLOW_ALLOW_CODE": "ppo.reward_fn"}


@pytest.fixture()
def allow_test_reward(monkeypatch):
    """This test's runs, and the commands they start, may name a reward of the tests as ppo.reward_fn."""
    for name, value in ALLOW_TEST_REWARD.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run faster on one thread, and far faster when other work shares the 2 cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tok():
    """The tiny tokenizer (byte-level BPE with a ChatML template)."""
    from tests.fixtures import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from tests.fixtures import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def tiny_pipeline_overrides(root: Path | str, model_dir: Path, *, tracking: bool = True) -> list[str]:
    """`--set` values that run the whole pipeline in seconds on tiny models, writing only under `root`
    (a relative root such as "." keeps paths relative to the repo, as DVC outputs must be)."""
    overrides = [
        f"data.preferences={root}/data/raw/demo/preferences.jsonl",
        f"data.demo.out_dir={root}/data/raw/demo",
        "data.demo.n_prompts=60",
        f"validate.out_dir={root}/data/validated",
        f"validate.report_dir={root}/reports/validation",
        f"sft.model={model_dir}",
        f"sft.out_dir={root}/models/sft",
        f"sft.train_data={root}/data/validated/train.jsonl",
        "sft.n_samples=2",
        "sft.max_new_tokens=8",
        "sft.perplexity_rows=4",  # as evaluate.perplexity_rows: evaluate takes the sft stage's figure
        "reward_model.backbone=sft",
        f"reward_model.out_dir={root}/models/reward_model",
        "reward_model.epochs=1",
        "reward_model.batch_size=8",
        f"reward_model.checkpoint_dir={root}/checkpoints/reward_model",
        "judge.backbone=sft",
        f"judge.out_dir={root}/models/judge",
        f"judge.checkpoint_dir={root}/checkpoints/judge",
        "judge.epochs=1",
        "judge.batch_size=8",
        f"ppo.out_dir={root}/models/policy",
        f"ppo.checkpoint_dir={root}/checkpoints/ppo",
        "ppo.steps=2",
        "ppo.batch_size=4",
        "ppo.mini_batch_size=2",
        "ppo.max_new_tokens=8",
        "ppo.checkpoint_every=1",
        "evaluate.n_prompts=4",
        "evaluate.max_new_tokens=8",
        "evaluate.perplexity_rows=4",
        f"evaluate.report_dir={root}/reports/evaluate",
        f"evaluate.reference_dir={root}/data/sft_answers",
        f"metrics_dir={root}/metrics",
    ]
    if tracking:
        overrides.append(f"tracking.tracking_uri=sqlite:///{root}/mlflow.db")
    return overrides


def copy_project(dest: Path, *, untracked: bool = True) -> None:
    """The project's files (`project_files`) into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    copy_files(REPO, dest, project_files(REPO, untracked=untracked))


def repo_runner(repo: Path, timeout: float = 900) -> Callable[..., subprocess.CompletedProcess]:
    """`run(*cmd)`: a command run in `repo` with the project's venv first on PATH, its output captured as text; a flow
    command talks to the test process's Prefect server."""
    path = f"{Path(PYTHON).parent}:{Path(sys.executable).parent}:{os.environ['PATH']}"  # dvc.yaml's `python` too
    env = {**os.environ, "PATH": path, "PYTHONPATH": str(repo)}
    env.pop("MLFLOW_TRACKING_URI", None)  # mlflow.set_tracking_uri in earlier tests exports it

    def run(*cmd: str) -> subprocess.CompletedProcess:
        run_env = with_prefect_api(env) if starts_a_flow(cmd) else env
        return subprocess.run(forked(cmd), cwd=repo, env=run_env, capture_output=True, text=True, timeout=timeout)

    return run


def make_dvc_repo(
    repo: Path, model_dir: Path, timeout: float = 900, extra: list[str] = ()
) -> Callable[..., subprocess.CompletedProcess]:
    """A git repo at `repo` holding the project's tracked files with params.yaml set to the tiny pipeline (paths
    relative to the repo, tracking to its default store `<repo>/mlflow.db`) and the `extra` overrides, committed.
    Returns `run(*cmd)`, which runs a command there with the project's venv first on PATH."""
    from rlhflow.config.params import load_config, write_params

    copy_project(repo)
    overrides = [*tiny_pipeline_overrides(".", model_dir, tracking=False), *extra]
    write_params(load_config(repo / "params.yaml", overrides), repo / "params.yaml")
    commit_all(repo, "init")
    return repo_runner(repo, timeout)


def shared_tmp_dir(tmp_path_factory) -> Path:
    """A directory all pytest-xdist workers of this pytest run share (the parent of their own base directories)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` while the block runs: one process of the pytest run at a time."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# a round of human feedback on the tiny pipeline: a feedback split to sample its pairs from, answers kept short
FEEDBACK_ROUND = ["validate.feedback_fraction=0.2", "feedback.n_pairs=4", "feedback.max_new_tokens=8"]


@pytest.fixture(scope="session")
def reproduced_baseline(tmp_path_factory) -> Path:
    """One tiny `dvc repro` in a git+DVC repo (MLflow store: the repo's mlflow.db; a feedback split, FEEDBACK_ROUND)
    for the whole pytest run, its dvc.lock and metrics committed as the baseline (what a DVC user does to keep one;
    `dvc exp show` compares experiments with it). The first worker to ask builds it, under a lock; the others wait
    and share it. It is never changed: a test works on its own `copy_repo` of it."""
    from tests.fixtures import write_tiny_model

    root = shared_tmp_dir(tmp_path_factory) / "reproduced-baseline"
    with exclusive_lock(root.with_suffix(".lock")):
        if not (root / "built").exists():
            shutil.rmtree(root, ignore_errors=True)
            run = make_dvc_repo(root / "repo", write_tiny_model(root / "model"), extra=FEEDBACK_ROUND)
            first = run("dvc", "repro")
            assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
            (root / "repro.log").write_text(first.stdout)
            for cmd in (
                ["git", "add", "-f", "dvc.lock", "metrics"],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "baseline"],
            ):
                done = run(*cmd)
                assert done.returncode == 0, done.stdout + done.stderr
            (root / "built").touch()
    return root / "repo"


def copy_repo(src: Path, dst: Path, timeout: float = 900) -> Callable[..., subprocess.CompletedProcess]:
    """A copy of the repo `src` (git, DVC cache, outputs and MLflow store) at `dst`, its store's paths moved with it
    (tests.fixtures.relocate_mlflow_store). Returns its `run(*cmd)`."""
    from tests.fixtures import relocate_mlflow_store

    shutil.copytree(src, dst, symlinks=True)
    if (dst / "mlflow.db").exists():
        relocate_mlflow_store(dst / "mlflow.db", src, dst)
    return repo_runner(dst, timeout)


def stage_command(module: str, overrides: list[str]) -> list[str]:
    """`python -m <module> --set ...`: a stage's CLI, as dvc.yaml runs it."""
    return [PYTHON, "-m", module] + [arg for o in overrides for arg in ("--set", o)]


def stage_env() -> dict[str, str]:
    # one thread: identical float reductions in every process, so runs compare exactly
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }


def run_stage_cli(module: str, overrides: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a stage's CLI to its end, as dvc.yaml runs it; its output captured as text."""
    cmd = stage_command(module, overrides)
    return subprocess.run(cmd, cwd=REPO, env=stage_env(), capture_output=True, text=True, timeout=timeout)


def kill_stage_once(cmd: list[str], marker: Path, timeout: float) -> None:
    """Start a stage's CLI and SIGKILL it (no clean-up can run) as soon as `marker` exists; fails when the stage
    ended before that."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=stage_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the stage finished before it could be killed"


def kill_training_once(module: str, overrides: list[str], checkpoint_dir: Path, checkpoint_every: int) -> int:
    """Start a training stage's CLI, SIGKILL it once its second Trainer checkpoint is complete, and return the step
    of the last complete checkpoint it left (the one a rerun resumes from)."""
    from rlhflow.training.hf_trainer import last_complete_checkpoint

    marker = checkpoint_dir / f"checkpoint-{2 * checkpoint_every}" / "trainer_state.json"
    kill_stage_once(stage_command(module, overrides), marker, timeout=300)
    return int(last_complete_checkpoint(checkpoint_dir).name.split("-")[-1])


def rerun_resumes(module: str, overrides: list[str], *, what: str, killed_at: int, out_dir: Path, checkpoint_dir: Path):
    """Rerun a killed training stage: it resumes from the checkpoint at step `killed_at`, writes its output, and
    leaves neither checkpoints nor the killed run's temp output behind."""
    rerun = run_stage_cli(module, overrides)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert f"{what}: resuming training from checkpoint-{killed_at} (step {killed_at})" in rerun.stdout
    assert (out_dir / "model.safetensors").exists()
    assert not checkpoint_dir.exists()  # finished: nothing left to resume
    assert not list(out_dir.parent.glob(f".{out_dir.name}.*"))  # the killed run's temp output dir was cleaned up


def flow_run_logs(flow_run_id) -> list[str]:
    """Every log message of a flow run and its task runs, as the Prefect API stores them."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    async def read() -> list[str]:
        await APILogHandler.aflush()  # log records are sent in the background
        only_this_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
        messages: list[str] = []
        async with get_client() as prefect:
            while True:  # the API returns at most 200 records a call
                page = await prefect.read_logs(log_filter=only_this_run, limit=200, offset=len(messages))
                messages += [log.message for log in page]
                if len(page) < 200:
                    return messages

    return asyncio.run(read())


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium (rlhfops/browser.py), checked before a browser test's servers start. Missing, it fails the
    test: CI must check the UIs."""
    from rlhfops import browser

    path = browser.chromium_path()
    if path is None:
        pytest.fail(browser.MISSING_CHROMIUM)
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for the servers the tests start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(root: Path) -> Iterator[str]:
    """`mlflow server` on 127.0.0.1 over the store <root>/mlflow.db (artifacts in <root>/mlartifacts), as `make ui`
    starts it, without authentication: it ignores the credentials a client sends. Yields its URL; stopped after."""
    from rlhfops.stack_access import MLFLOW_SERVER_ENV, mlflow_server_command
    from rlhfops.tracking import sqlite_artifact_root

    uri = f"sqlite:///{root}/mlflow.db"
    port = free_port()
    env = {**MLFLOW_SERVER_ENV, **os.environ}
    env.pop("MLFLOW_TRACKING_URI", None)  # mlflow.set_tracking_uri in the pipeline exports it
    log_path = root / "mlflow-server.log"
    server = mlflow_server_command(uri, "127.0.0.1", port, sqlite_artifact_root(uri))
    with log_path.open("w") as log:
        # its own process group: uvicorn and the job runner with it
        proc = subprocess.Popen(server, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300  # its start takes ~10 s alone, minutes on a busy 2-core machine
            while not _answers_api(url):
                assert proc.poll() is None, f"mlflow server exited: {log_path.read_text()}"
                assert time.monotonic() < deadline, "mlflow server did not answer its API within 300 s"
                time.sleep(0.5)
            yield url
        finally:
            stop_group(proc)


def stop_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Stop a server started in its own process group: SIGTERM to the whole group at once (the parent alone passes
    it on to its workers only after its own shutdown), then SIGKILL to whatever of the group is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _answers_api(url: str) -> bool:
    """Whether the server answers an API call: /health answers before the first call's lazy imports are done,
    which on a busy machine take longer than the pipeline's preflight waits."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/api/2.0/mlflow/experiments/search?max_results=1", timeout=30) as response:
            return response.status == 200
    except OSError:
        return False


# ---- the suite's order and its markers ------------------------------------------------------------------------

# The files that take longest (`--durations` of `make test`, two workers), longest first: the suite hands them out
# first (`--no-loadscope-reorder` keeps this order; xdist would otherwise start with the files that hold the most
# tests, and a one-test file of five minutes would start last and run alone at the end).
SLOWEST_FILES = (
    "test_lineage.py",
    "test_feedback_browser.py",
    "test_launch.py",
    "test_evaluate.py",
    "test_bench_smoke.py",
    "test_prefect_server.py",
    "test_align.py",
    "test_sft_train.py",
    "test_sweep.py",
    "test_real_data.py",
    "test_mlflow_ui.py",
    "test_restore_safety.py",
    "test_flow_skipping.py",
    "test_faults.py",
    "test_distributed.py",
    "test_stage_deps.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOWEST_FILES)))  # stable: the rest keep their order


LAUNCHING_MARKERS = ("system", "e2e", "stack")
platform.processor()  # MLflow's import asks it, which runs `uname -p` once a process: here, before any test's guard


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The markers are true: a test not marked `system` (nor `e2e` or `stack`) that starts a process or a server,
    in its fixtures or its body, fails naming what it started, so `make test-fast` holds only tests that start
    nothing (but git, which the config's path check asks what it tracks: milliseconds)."""
    if any(item.get_closest_marker(m) for m in LAUNCHING_MARKERS):
        yield
        return
    real_init = subprocess.Popen.__init__

    def refuse(self, args, *more, **kwargs):
        if Path(str(args[0] if isinstance(args, list | tuple) else args).split()[0]).name == "git":
            return real_init(self, args, *more, **kwargs)  # the config's path check asks git what it tracks
        raise AssertionError(f"{item.nodeid} starts a process ({args!r}): mark it `system`")

    subprocess.Popen.__init__ = refuse
    try:
        yield
    finally:
        subprocess.Popen.__init__ = real_init
