"""A newcomer's first `make run` log says what the run does, not what libraries did underneath: no bytecode listing
(dill's disassembly of a function datasets fingerprints, sent to the run log by Prefect's log_prints), no DVC warning
about an empty code dep, no MLflow advice on how models are logged, no transformers load report for the score head
a reward model is built with."""

from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, stage_command, stage_env, tiny_pipeline_overrides

from rlhflow.config.params import REPO_ROOT
from rlhfops import stage_lock
from rlhfops.codedeps import PROJECT_PACKAGES

# a line of `dis` output, bare or behind Prefect's log prefix ("... | Task run 'x' - 160  2 LOAD_GLOBAL  0 (pa)")
BYTECODE = re.compile(r"^(?:.* - )?[\s>]*(?:\d+\s+)+(?:RESUME|LOAD_\w+|STORE_\w+|CALL\w*|RETURN_VALUE)\b", re.M)
NOISE = ("is empty", "CloudPickle", "Add type hints to the `predict` method", "MISSING")


def noise(log: str) -> list[str]:
    return [m.group(0).strip() for m in BYTECODE.finditer(log)][:3] + [n for n in NOISE if n in log]


@pytest.mark.system
def test_the_flow_log_of_a_reward_model_stage_has_no_library_noise(tmp_path, tiny_model_dir):
    """The flow, as `make run` starts it, running the reward model stage on tiny models (RewardTrainer's dataset, the
    new score head, the logged pyfunc model) on validated splits written here. The judge stage runs the same code."""
    import pandas as pd

    from rlhflow.data.readers import write_jsonl

    rows = [
        {
            "prompt": f"question {i}?",
            "prompt_messages": [{"role": "user", "content": f"question {i}?"}],
            "chosen": f"Here are three clear steps for question {i}.",
            "rejected": "no",
            "source_row": i + 1,
        }
        for i in range(16)
    ]
    write_jsonl(pd.DataFrame(rows), tmp_path / "data/validated/train.jsonl")
    write_jsonl(pd.DataFrame(rows[:4]), tmp_path / "data/validated/test.jsonl")
    overrides = [*tiny_pipeline_overrides(tmp_path, tiny_model_dir), f"reward_model.backbone={tiny_model_dir}"]
    cmd = [*stage_command("flows.pipeline", overrides), "--stages", "reward_model"]
    # its own temporary Prefect server, given time to start on a busy machine
    env = {
        **stage_env(),
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert (tmp_path / "metrics/reward_model.json").exists(), log[-4000:]
    found = noise(log)
    assert found == [], f"{found}\n{log[-8000:]}"


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
