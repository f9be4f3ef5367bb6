"""A newcomer's first `make run` log says what the run does, not what libraries did underneath: no bytecode listing
(dill's disassembly of a function datasets fingerprints, sent to the run log by Prefect's log_prints), no DVC warning
about an empty code dep or an empty feedback file, DVC's record of a stage said once, no MLflow advice on how models
are logged, no transformers load report for the score head a reward model is built with nor a bar for each model
loaded, and the Trainer's figures as one line, not its dicts."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import copy_repo, stage_env

from rlhflow.config.params import REPO_ROOT
from rlhfops import stage_lock
from rlhfops.codedeps import PROJECT_PACKAGES

# a line of `dis` output, bare or behind Prefect's log prefix ("... | Task run 'x' - 160  2 LOAD_GLOBAL  0 (pa)")
BYTECODE = re.compile(r"^(?:.* - )?[\s>]*(?:\d+\s+)+(?:RESUME|LOAD_\w+|STORE_\w+|CALL\w*|RETURN_VALUE)\b", re.M)
NOISE = ("is empty", "CloudPickle", "Add type hints to the `predict` method", "MISSING")


def noise(log: str) -> list[str]:
    return [m.group(0).strip() for m in BYTECODE.finditer(log)][:3] + [n for n in NOISE if n in log]


# what the log of a stage that loads and trains models says once, at most: DVC's record, the Trainer's summary line
ONCE_A_STAGE = ("Updating lock file 'dvc.lock'", "reward model: trained ")
# what it never says: the Trainer's figures as a dict, transformers' bar for each model it loads
NEVER = ("{'loss'", "'train_runtime'", "Loading weights")


@pytest.mark.system
def test_the_flow_log_of_the_stages_a_run_records_has_no_library_noise(tmp_path, reproduced_baseline):
    """The flow, as `make run` starts it, in a copy of the tiny reproduced DVC repo (DVC records each stage there):
    validate with empty feedback files (the state a project without a feedback round is in) and the reward model
    (RewardTrainer's dataset, the new score head, the logged pyfunc model). The judge stage runs the same code."""
    repo = tmp_path / "repo"
    copy_repo(reproduced_baseline, repo)
    assert (repo / "data/feedback/labels.jsonl").stat().st_size == 0
    cmd = [sys.executable, "-m", "flows.pipeline", "--stages", "validate,reward_model", "--force"]
    # its own temporary Prefect server, given time to start on a busy machine
    env = {
        **stage_env(),
        "PYTHONPATH": str(repo),
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "validate: running" in log and "reward_model: running" in log, log[-4000:]
    found = noise(log) + [n for n in NEVER if n in log]
    assert found == [], f"{found}\n{log[-8000:]}"
    assert log.count(ONCE_A_STAGE[0]) == 2 and log.count(ONCE_A_STAGE[1]) == 1, log[-8000:]


def test_prints_into_a_captured_stdout_stay_out_of_the_run_log(monkeypatch):
    """Fingerprinting an Arrow table (datasets does, for each map RewardTrainer runs) makes dill print a function's
    disassembly into a captured stdout; Prefect's print (stood in for here) logged it. Stage tasks run inside
    redirected_prints_not_logged: dill gets its listing, the run log only what the stage prints."""
    import builtins

    import pyarrow as pa
    from datasets.fingerprint import Hasher

    from rlhfops.stage_runner import redirected_prints_not_logged

    table = pa.table({"x": [1, 2]})
    plain = Hasher.hash(table)
    run_log: list[str] = []
    monkeypatch.setattr(builtins, "print", lambda *values, **kwargs: run_log.append(" ".join(map(str, values))))
    with redirected_prints_not_logged():
        fingerprint = Hasher.hash(table)
        print("the stage says")
    assert run_log == ["the stage says"]
    assert fingerprint == plain  # dill read the globals from its listing, as without Prefect


def test_dvc_records_the_stages_code_without_warnings(caplog):
    """What DVC does with each stage's code deps when the flow (or `dvc repro`) records a run: hash them. An empty
    file among them made DVC warn "'tasks/__init__.py' is empty." after every stage."""
    from dvc.dependency.param import ParamsDependency

    packages = [REPO_ROOT / p for p in PROJECT_PACKAGES]
    with stage_lock.dvc_repo() as repo, caplog.at_level(logging.WARNING):
        for dstage in repo.index.stages:  # dvc.yaml's
            for dep in dstage.deps:
                path = Path(dep.fs_path)
                if not isinstance(dep, ParamsDependency) and any(path.is_relative_to(p) for p in packages):
                    if path.is_file():
                        dep.save()
    assert noise("\n".join(r.getMessage() for r in caplog.records)) == []


def test_task_run_lines_name_their_task_and_bookkeeping_completions_are_left_out():
    """The UI's log of a flow run shows a task run's message without its name: a stage's "Finished in state" line
    names the stage; the flow's bookkeeping tasks (up-to-date checks, records) say nothing when they complete."""
    from flows.pipeline_flow import TaskRunLines

    def line(task: str, message: str, level: int = logging.INFO) -> logging.LogRecord | None:
        record = logging.LogRecord("prefect.task_runs", level, __file__, 1, message, (), None)
        record.task_name = task
        return record if TaskRunLines().filter(record) else None

    assert line("ppo", "Finished in state Completed()").getMessage() == "ppo finished in state Completed()"
    assert line("record-stage", "Finished in state Completed()") is None
    failed = line("record-stage", "Finished in state Failed('disk full')", logging.ERROR)
    assert failed.getMessage() == "record-stage finished in state Failed('disk full')"
    assert line("ppo", "reward model: trained 52 steps").getMessage() == "reward model: trained 52 steps"
    assert any(isinstance(f, TaskRunLines) for f in logging.getLogger("prefect.task_runs").filters)


def test_progress_lines_come_at_most_every_so_many_seconds(capsys):
    """A stage's progress reaches the run log as print()ed lines, at most one every PROGRESS_SECONDS; a line's text
    is made only when it is printed."""
    from rlhflow.progress import PROGRESS_SECONDS, ProgressLines

    now = [0.0]
    lines = ProgressLines("ppo", clock=lambda: now[0])
    made = []
    for t in (1.0, PROGRESS_SECONDS, PROGRESS_SECONDS + 5, 2 * PROGRESS_SECONDS + 1):
        now[0] = t
        lines(lambda t=t: made.append(t) or f"at {t:g} s")
    assert capsys.readouterr().out.splitlines() == [
        f"ppo: at {PROGRESS_SECONDS:g} s",
        f"ppo: at {2 * PROGRESS_SECONDS + 1:g} s",
    ]
    assert made == [PROGRESS_SECONDS, 2 * PROGRESS_SECONDS + 1]


def test_the_progress_interval_is_30_s_unless_the_environment_names_another(monkeypatch):
    """$RLHFLOW_PROGRESS_SECONDS (0: a line at every step, as the Prefect UI test runs); anything but a number of
    seconds >= 0 fails naming the variable."""
    from rlhflow.progress import _progress_seconds

    monkeypatch.delenv("RLHFLOW_PROGRESS_SECONDS", raising=False)
    assert _progress_seconds() == 30.0
    monkeypatch.setenv("RLHFLOW_PROGRESS_SECONDS", "0")
    assert _progress_seconds() == 0.0
    for bad in ("-1", "nan", "soon"):
        monkeypatch.setenv("RLHFLOW_PROGRESS_SECONDS", bad)
        with pytest.raises(ValueError, match=r"\$RLHFLOW_PROGRESS_SECONDS must be a number of seconds >= 0"):
            _progress_seconds()
