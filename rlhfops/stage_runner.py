"""What every stage shares: the MLflow stage run, timing, the metrics file, the Prefect task and the CLI.

A stage module defines `run(cfg, ctx) -> dict[str, float]` (its metrics) and ends with
`task = stage_task(NAME, run)` and `if __name__ == "__main__": cli(NAME, run)`. The Prefect flow and
`python -m tasks.<stage>` (what dvc.yaml calls) therefore run exactly the same code.

A stage's door is light: importing this module loads none of the stack. Prefect is loaded when the flow calls a
stage's task (a stage run by DVC or by hand never loads it), MLflow and the DVC record when the stage runs, after
its command line is parsed (`--help` answers at once).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

# Quiet, offline defaults for the libraries the stages use (users can override them in the environment).
os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

# A light door: prefect, mlflow (rlhfops.tracking) and DVC's record (rlhfops.stage_lock) load inside the functions
# that use them.
from rlhflow.config.params import REPO_ROOT, Config, parse_config_args  # noqa: E402
from rlhflow.training import distributed  # noqa: E402
from rlhfops import workspace  # noqa: E402
from rlhfops.stages import FLOW_ENV, get_stage, parent_run_option  # noqa: E402


def _print_to_stdout(*values, sep: str | None = " ", end: str | None = "\n", file=None, flush: bool = False) -> None:
    """What print() does: Prefect's log_prints replaces print, and may have done so before this module is imported
    (the flow imports stage modules while it runs), so the original cannot be kept."""
    stream = sys.stdout if file is None else file
    stream.write((" " if sep is None else sep).join(map(str, values)) + ("\n" if end is None else end))
    if flush:
        stream.flush()


@contextlib.contextmanager
def prints_to_stdout() -> Iterator[None]:
    """print() writes to stdout inside the block, also in a Prefect run with log_prints. dill (datasets' fingerprint
    of each function trl maps over a dataset) reads a function's globals from the disassembly it prints into a
    captured stdout; Prefect's print would send that disassembly, hundreds of lines per function, to the run log."""
    patched, builtins.print = builtins.print, _print_to_stdout
    try:
        yield
    finally:
        builtins.print = patched


@contextlib.contextmanager
def redirected_prints_not_logged() -> Iterator[None]:
    """print() into a stream that code redirected stdout or stderr to (contextlib.redirect_stdout, dill's capture)
    goes to that stream, also under Prefect's log_prints, whose print logs whatever targets sys.stdout, redirected or
    not. dill lists a function's globals by reading its disassembly back from a captured stdout (datasets
    fingerprints what trl's trainers map over a dataset, e.g. RewardTrainer's pairs): the run log got the bytecode
    and dill no globals. Prints to the stage's own stdout and stderr still go to the run log."""
    logging_print, own = builtins.print, (sys.stdout, sys.stderr)

    def print_(*values, sep: str | None = " ", end: str | None = "\n", file=None, flush: bool = False) -> None:
        target = sys.stdout if file is None else file
        if any(target is stream for stream in own):
            logging_print(*values, sep=sep, end=end, file=file, flush=flush)
        else:
            _print_to_stdout(*values, sep=sep, end=end, file=target, flush=flush)

    builtins.print = print_
    try:
        yield
    finally:
        builtins.print = logging_print


@dataclass
class StageContext:
    """Handed to a stage body: where to log, and the runs its metrics go to."""

    stage: str
    parent_run_id: str | None = None
    run_id: str | None = None
    main_process: bool = True  # False in the other processes of a multi-process run: they log nothing

    def log_metrics(self, metrics: dict[str, float], step: int | None = None, *, on_parent: bool = False) -> None:
        if not self.main_process:
            return
        from rlhfops import tracking

        tracking.log_metrics(metrics, step=step, run_ids=[self.parent_run_id] if on_parent else [])


StageBody = Callable[[Config, StageContext], dict[str, float]]


def run_stage(name: str, body: StageBody, cfg: Config, parent_run_id: str | None = None) -> dict[str, float]:
    """Run one stage inside its MLflow child run; write metrics/<stage>.json when the stage declares one.

    Under `accelerate launch` with several processes, only the main process (rank 0) opens the run and writes
    the metrics file; in data parallel stages (`Stage.data_parallel`) the others run the body with
    `ctx.main_process` False (they train their data shard and must write nothing). They return no metrics."""
    from rlhfops import tracking  # mlflow: loaded once the stage runs

    distributed.init()
    stage = get_stage(name)
    if not distributed.is_main_process():
        if stage.data_parallel:
            body(cfg, StageContext(stage=name, main_process=False))
        return {}
    sections = [p.split(".")[0] for p in stage.params]
    with tracking.stage_run(cfg, name, sorted(set(sections)), parent_run_id=parent_run_id) as run:
        ctx = StageContext(stage=name, parent_run_id=parent_run_id, run_id=run.info.run_id)
        start = time.perf_counter()
        metrics = dict(body(cfg, ctx) or {})
        metrics[f"time/{name}_s"] = time.perf_counter() - start
        ctx.log_metrics({f"time/{name}_s": metrics[f"time/{name}_s"]})
        if stage.metrics:
            tracking.write_stage_metrics(cfg, name, metrics)
    return metrics


class StageTask:
    """The stage as a Prefect task: no retries (training is not idempotent), no result caching. Called inside a
    flow it runs as that flow's task run; the Prefect task is built at its first call, so that importing a stage
    module (its command line, `dvc repro`) does not load Prefect."""

    def __init__(self, name: str, body: StageBody):
        self.name, self.body = name, body

    @functools.cached_property
    def prefect_task(self):
        from prefect import task
        from prefect.cache_policies import NO_CACHE

        name, body = self.name, self.body

        @task(name=name, retries=0, cache_policy=NO_CACHE)
        def _task(cfg: Config, parent_run_id: str | None = None) -> dict[str, float]:
            with redirected_prints_not_logged():
                return run_stage(name, body, cfg, parent_run_id)

        return _task

    def __call__(self, cfg: Config, parent_run_id: str | None = None) -> dict[str, float]:
        return self.prefect_task(cfg, parent_run_id)


def stage_task(name: str, body: StageBody) -> StageTask:
    return StageTask(name, body)


def holding_the_workspace(name: str):
    """A stage run alone holds the workspace while it runs (rlhfops/workspace.py). Under `dvc repro` (DVC_STAGE set)
    it does not wait for a pipeline run holding it, as DVC's lock is held meanwhile: it stops before any work. The
    other processes of an `accelerate launch` run share their main process's hold."""
    if os.environ.get("RANK", "0") != "0" or FLOW_ENV in os.environ:  # the flow that launched it holds it
        return contextlib.nullcontext()
    under_dvc = "DVC_STAGE" in os.environ
    return workspace.exclusive(
        f"stage {name} ({'dvc repro' if under_dvc else f'python -m tasks.{name}'})", wait=not under_dvc
    )


def record_by_hand(name: str, cfg: Config) -> None:
    """After a stage run by hand (not by `dvc repro`, which records it, nor by a flow, which does): its lock entry
    and outputs in the DVC cache, as the flow records a stage, so that the next flow run or `dvc repro` finds it up
    to date; or a line saying why it is not recorded."""
    if not distributed.is_main_process() or "DVC_STAGE" in os.environ or FLOW_ENV in os.environ:
        return

    stage = get_stage(name)
    outside = [
        p for p in (stage.resolve(cfg, t) for t in stage.outs) if not cfg.path(p).resolve().is_relative_to(REPO_ROOT)
    ]
    if outside:
        print(f"{name}: not recorded in the lock: its output {outside[0]} lies outside the project {REPO_ROOT}")
        return
    from rlhfops import stage_lock  # DVC: loaded to record a run, not to start one

    stage_lock.record_run(stage, cfg)
    print(f"{name}: recorded ({stage_lock.LOCK_FILE if stage_lock.is_dvc_project() else 'the flow lock'})")


def cli(name: str, body: StageBody, argv: list[str] | None = None) -> None:
    description = f"Run the {name} stage alone: {get_stage(name).description}."
    cfg, args = parse_config_args(argv, description, (parent_run_option(),))
    from rlhfops import tracking  # mlflow: after the command line is parsed, so that --help answers at once

    try:
        tracking.preflight(cfg)  # an unreachable tracking server fails here, in seconds, not after training
        with holding_the_workspace(name):
            metrics = run_stage(name, body, cfg, parent_run_id=args.parent_run_id)
            record_by_hand(name, cfg)
    except Exception as err:  # a clear one-paragraph error, not a traceback, for data and config problems
        if isinstance(err, (ValueError, FileNotFoundError, tracking.TrackingUnavailableError, workspace.WorkspaceBusy)):
            sys.stderr.write(f"\n{name} failed: {err}\n")
            sys.exit(1)
        raise
    for key, value in sorted(metrics.items()):
        print(f"{key:32s} {value:.4f}")
