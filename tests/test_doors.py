"""Light doors: every command imports what its work needs, where it needs it. Each entry point's `--help`, in a fresh
interpreter, loads none of the stack (only the config's pydantic and yaml), and a stage loads no library that its
own work and its tracking do not use. What is pinned is the set of modules in `sys.modules`, never a time: the
times are `python -m bench.doors` (docs/benchmarks.md#light-doors-how-fast-a-command-answers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, tiny_pipeline_overrides

from bench.doors import ENTRY_POINTS, HEAVY

pytestmark = pytest.mark.system  # each check starts a fresh interpreter

PROBE = """
import json, runpy, sys
sys.argv = [sys.argv[1], *sys.argv[2:]]
try:
    runpy.run_module(sys.argv[0], run_name="__main__")
except SystemExit as stop:
    code = stop.code
else:
    code = 0
print(json.dumps({"code": code, "loaded": sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)}), file=sys.stderr)
"""


def loaded_by(module: str, *args: str) -> tuple[int | str, set[str]]:
    """Run `python -m module args...` in a fresh interpreter: its exit code and the heavy modules it loaded."""
    probe = f"HEAVY = {sorted(HEAVY)!r}\n{PROBE}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", probe, module, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    last = done.stderr.strip().splitlines()[-1]
    report = json.loads(last)
    return report["code"], {name.split(".")[0] for name in report["loaded"]}


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_loads_none_of_the_stack(module):
    code, loaded = loaded_by(module, "--help")
    assert code in (0, None), f"{module} --help exited {code}"
    assert not loaded, f"{module} --help loads {sorted(loaded)}"


def test_a_stage_loads_only_what_its_work_and_tracking_use(tmp_path):
    """demo_data writes one small file: its run loads MLflow (its tracking) and no torch, transformers, Great
    Expectations, Prefect or DVC."""
    tiny = tiny_pipeline_overrides(tmp_path, tmp_path / "no-model")
    overrides = [o for o in tiny if o.startswith(("data.", "metrics"))]
    overrides.append(f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db")
    code, loaded = loaded_by("tasks.demo_data", *[a for o in overrides for a in ("--set", o)])
    assert code in (0, None)
    assert (tmp_path / "data/raw/demo/preferences.jsonl").is_file()
    assert "mlflow" in loaded
    assert not loaded & {"torch", "transformers", "great_expectations", "prefect", "dvc", "peft", "trl"}, loaded


def test_a_team_stage_flow_starts_without_torch():
    """Every stage of a team run starts as a flow run of flows.team_flow on a worker, the stages that turn out up to
    date and the light ones included: it loads Prefect and MLflow, and checks the judge's settings without torch or
    transformers, which only a stage's own work loads (rlhflow/evaluation/judging.py)."""
    code, loaded = loaded_by("flows.team_flow")
    assert code in (0, None)
    assert {"prefect", "mlflow"} <= loaded
    assert not loaded & {"torch", "transformers", "peft", "trl"}, loaded
