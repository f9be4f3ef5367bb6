"""An edit reruns only what it touches: each stage's code deps (dvc.yaml, from rlhfops/codedeps.py) are the files it
runs. Checked statically on the import closures, and for real: one tiny `dvc repro` in a git repo copy of the
project, then for each file a comment line appended, `dvc status` names exactly the stages that changed, and the
file is restored (`git checkout`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import copy_repo

from rlhflow.config.params import REPO_ROOT
from rlhfops.codedeps import import_closure
from rlhfops.dvc_yaml import stage_deps
from rlhfops.stages import STAGE_NAMES, STAGES

# ---- the import closures ---------------------------------------------------------------------------------------

# files that only some stages run: what every stage imports (rlhfops/stage_runner.py, the tracking it uses) loads none
STAGE_SPECIFIC = {
    "rlhflow/models/loading.py",
    "rlhflow/models/policy.py",
    "rlhflow/training/reward_model.py",
    "tasks/pairwise_training.py",
    "rlhflow/evaluation/metrics.py",
    "rlhflow/models/packed_linear.py",
    "rlhflow/models/logits.py",
    "rlhflow/data/validation.py",
    "rlhflow/data/formats.py",
    "rlhflow/ppo/__init__.py",
    "rlhfops/serving/__init__.py",
}


# the modules in tasks/ that are not stages: the body the two pairwise-model stages share, and the evaluation's
# settings the two evaluating stages read
SHARED_STAGE_BODIES = {
    "reward_model": {"tasks/pairwise_training.py"},
    "judge": {"tasks/pairwise_training.py"},
    "sft_answers": {"tasks/evaluation_setup.py"},
    "evaluate": {"tasks/evaluation_setup.py"},
}


def test_no_stage_module_imports_another_stage_module():
    for s in STAGES:
        tasks_files = {f for f in import_closure(s.module) if f.startswith("tasks/")}
        assert tasks_files == {"tasks/__init__.py", f"tasks/{s.name}.py", *SHARED_STAGE_BODIES.get(s.name, ())}, s.name


@pytest.mark.parametrize("module", ["rlhfops.stage_runner", "rlhfops.tracking"])
def test_what_every_stage_imports_loads_no_stage_specific_code(module):
    assert not set(import_closure(module)) & STAGE_SPECIFIC, import_closure(module)


@pytest.mark.parametrize(
    "package",
    ["rlhflow.config", "rlhflow.models", "rlhflow.training", "rlhflow.ppo", "rlhflow.evaluation", "rlhfops.serving"],
)
def test_package_inits_import_none_of_their_modules(package):
    top = package.split(".")[0]
    assert import_closure(package) == (f"{top}/__init__.py", f"{package.replace('.', '/')}/__init__.py")


def test_the_per_token_kl_and_the_figures_do_not_load_ppo():
    assert not [f for f in import_closure("rlhflow.evaluation.metrics") if f.startswith("rlhflow/ppo/")]
    assert import_closure("rlhflow.evaluation.plots") == (
        "rlhflow/__init__.py",
        "rlhflow/evaluation/__init__.py",
        "rlhflow/evaluation/plots.py",
    )
    assert "rlhflow/models/policy.py" not in import_closure("rlhfops.serving.reward")
    assert "rlhflow/training/reward_model.py" not in import_closure("rlhfops.serving.policy")


def code_files(stage) -> set[str]:
    """The project .py files a stage's deps cover (a listed directory, `rlhflow/ppo`, counts as its files)."""
    files: set[str] = set()
    for dep in stage_deps(stage):
        path = REPO_ROOT / dep
        if "${" in dep:
            continue
        if path.is_dir():
            files |= {f.relative_to(REPO_ROOT).as_posix() for f in path.rglob("*.py") if "__pycache__" not in f.parts}
        elif dep.endswith(".py"):
            files.add(dep)
    return files


def test_docs_state_each_stages_code_files():
    """docs/dvc.md's table (stage, code files, those besides the shared ones) is what the stage list says."""
    text = (REPO_ROOT / "docs/dvc.md").read_text()
    shared = set(import_closure("rlhfops.stage_runner"))
    section = text[text.index("## Code deps: what an edit reruns") :]
    section = section[: section.index("\n## ")]
    stated_shared = re.search(
        r"the same (\d+) files through\s+`rlhfops/stage_runner.py` \([^)]*\):(.*?)\. An edit", section, re.S
    )
    assert stated_shared, "docs/dvc.md does not state the files every stage imports"
    assert int(stated_shared[1]) == len(shared) and set(re.findall(r"`([^`]+)`", stated_shared[2])) == shared
    rows = {
        m[1]: (int(m[2]), set(re.findall(r"`([^`]+)`", m[3])))
        for m in re.finditer(r"^\| `(\w+)` \| (\d+) \| (.*) \|$", section, re.M)
    }
    assert set(rows) == set(STAGE_NAMES)
    for s in STAGES:
        files = code_files(s)
        assert shared <= files, s.name
        assert rows[s.name] == (len(files), files - shared), f"docs/dvc.md: {s.name} has {len(files)} code files"


# ---- dvc status after an edit, in a real git+DVC repo ----------------------------------------------------------

EVERY_STAGE = set(STAGE_NAMES)

# file edited -> the stages `dvc status` reports changed (their own code deps; downstream stages follow only once
# these rerun and change their outputs)
STALE_AFTER_EDIT = {
    "rlhflow/ppo/core.py": {"ppo"},
    "rlhflow/ppo/trainer.py": {"ppo"},
    "rlhflow/training/reward_model.py": {"reward_model", "judge", "sft_answers", "ppo", "evaluate"},
    "tasks/pairwise_training.py": {"reward_model", "judge"},
    "tasks/reward_model.py": {"reward_model"},
    "rlhflow/data/validation.py": {"validate", "sft"},
    "rlhflow/models/policy.py": {"sft", "sft_answers", "ppo", "evaluate"},
    "rlhflow/evaluation/metrics.py": {"sft", "evaluate"},  # sft_answers samples and scores, measures nothing
    "rlhflow/evaluation/judges.py": {"judge", "sft_answers", "evaluate"},
    "rlhflow/evaluation/plots.py": {"evaluate"},
    "rlhfops/serving/reward.py": {"reward_model", "judge"},
    "rlhfops/serving/policy.py": {"sft", "ppo"},
    "rlhflow/data/demo.py": {"demo_data"},
    "rlhfops/tracking.py": EVERY_STAGE,
}


@pytest.fixture(scope="module")
def reproduced(tmp_path_factory, reproduced_baseline):
    """A copy of the pytest run's tiny reproduced repo (conftest.reproduced_baseline); yields (repo, run)."""
    repo = tmp_path_factory.mktemp("deps") / "repo"
    return repo, copy_repo(reproduced_baseline, repo)


def changed_stages(run) -> set[str]:
    done = run("dvc", "status", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    return set(json.loads(done.stdout or "{}"))


@pytest.mark.system
def test_after_repro_every_stage_is_up_to_date(reproduced):
    _, run = reproduced
    assert changed_stages(run) == set()


@pytest.mark.system
@pytest.mark.parametrize("path", sorted(STALE_AFTER_EDIT))
def test_an_edit_changes_only_the_stages_that_run_the_file(reproduced, path):
    repo, run = reproduced
    with (repo / path).open("a") as f:
        f.write("# an edit\n")
    try:
        changed = changed_stages(run)
    finally:
        restored = run("git", "checkout", "--", path)
    assert restored.returncode == 0, restored.stderr
    assert changed == STALE_AFTER_EDIT[path], f"{path}: up to date: {sorted(EVERY_STAGE - changed)}"
    assert changed_stages(run) == set()  # restored: nothing left changed


# ---- the interpreter dvc.yaml's commands run ------------------------------------------------------------------


@pytest.mark.system
def test_dvc_repro_runs_a_stage_in_the_activated_venv_and_names_any_other_python(tmp_path, reproduced_baseline):
    """The README's forms: with the venv activated (its bin first on PATH, as `run` has it) `dvc repro` runs a stage.
    `.venv/bin/dvc repro` without it runs dvc.yaml's `python` from the PATH, here one without the stack (site-packages
    off): each kind of stage command (a stage module, the launcher of a data-parallel stage) stops in one line that
    names the interpreter and what to do, with no traceback."""
    repo = tmp_path / "repo"
    run = copy_repo(reproduced_baseline, repo)
    activated = run("dvc", "repro", "--force", "--single-item", "demo_data")
    assert activated.returncode == 0, activated.stdout[-2000:] + activated.stderr[-2000:]

    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python").write_text(f'#!/bin/sh\nexec {sys._base_executable} -S "$@"\n')
    (bare / "python").chmod(0o755)
    prefixed = {**os.environ, "PATH": f"{bare}:/usr/bin:/bin"}
    dvc = str(Path(sys.executable).parent / "dvc")
    for stage in ("demo_data", "reward_model"):  # `python -m tasks.demo_data`, `python -m rlhfops.launch reward_model`
        done = subprocess.run(
            [dvc, "repro", "--force", "--single-item", stage], cwd=repo, env=prefixed, capture_output=True, text=True
        )
        said = [line for line in done.stderr.splitlines() if "has no torch" in line]
        assert done.returncode != 0 and len(said) == 1, done.stdout[-2000:] + done.stderr[-2000:]
        assert said[0].startswith(f"{sys._base_executable} has no torch, transformers, mlflow, prefect, dvc: ")
        assert "source .venv/bin/activate" in said[0] and "Traceback" not in done.stderr, done.stderr[-2000:]
