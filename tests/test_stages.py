"""One stage list drives both the Prefect flow and dvc.yaml."""

import pytest
import yaml

from rlhflow.config.params import REPO_ROOT, load_config
from rlhfops.dvc_yaml import dvc_yaml, stage_deps
from rlhfops.stages import STAGES

FLOW_ORDER = ["demo_data", "validate", "sft", "reward_model", "judge", "sft_answers", "ppo", "evaluate"]


def test_dvc_yaml_is_generated_from_the_stage_list():
    committed = (REPO_ROOT / "dvc.yaml").read_text()
    assert committed == dvc_yaml(), "dvc.yaml is stale: run `make dvc-yaml`"


def test_stage_order_and_commands():
    assert [s.name for s in STAGES] == FLOW_ORDER
    stages = yaml.safe_load(dvc_yaml())["stages"]
    for s in STAGES:
        # data-parallel stages go through the launcher, which starts launch.<stage> processes of the same module
        launcher = f"python -m rlhfops.launch {s.name}"
        assert stages[s.name]["cmd"] == (launcher if s.data_parallel else f"python -m tasks.{s.name}")
        assert (REPO_ROOT / "tasks" / f"{s.name}.py").exists()
        if s.data_parallel:
            assert {f"launch.{s.name}", "launch.accelerate_config"} <= set(s.params)


def test_stage_properties():
    assert [s.name for s in STAGES if s.accelerator] == [
        "sft",
        "reward_model",
        "judge",
        "sft_answers",
        "ppo",
        "evaluate",
    ]
    assert [s.name for s in STAGES if s.data_parallel] == ["reward_model", "judge", "ppo"]
    assert all(s.accelerator for s in STAGES if s.data_parallel)


def test_templates_resolve_to_the_configured_paths():
    cfg = load_config(overrides=["sft.out_dir=models/other-sft"])
    sft = next(s for s in STAGES if s.name == "sft")
    assert sft.resolve(cfg, sft.outs[0]) == "models/other-sft"
    ppo = next(s for s in STAGES if s.name == "ppo")
    assert ppo.resolve(cfg, ppo.metrics[0]) == "metrics/ppo.json"


def test_every_code_dependency_exists():
    for s in STAGES:
        for dep in stage_deps(s):
            if "${" not in dep:
                assert (REPO_ROOT / dep).exists(), f"{s.name}: dependency {dep} does not exist"


def test_each_stage_reads_the_outputs_of_earlier_stages_only():
    cfg = load_config()
    # the inputs given before any stage runs: the preference data (the user's, or demo_data's output) and the pairs
    # and labels of a feedback round (docs/feedback.md)
    given = ("${data.preferences}", "${feedback.pairs_file}", "${feedback.labels_file}")
    produced = {STAGES[0].resolve(cfg, g) for g in given}
    for s in STAGES:
        for dep in s.deps:
            if dep.startswith("${"):
                path = s.resolve(cfg, dep)  # an output, or a file inside an output dir (sft's demonstrations)
                assert path in produced or any(path.startswith(p + "/") for p in produced), (
                    f"{s.name} reads {dep} before any stage writes it"
                )
        produced.update(s.resolve(cfg, o) for o in s.outs + s.metrics + s.plots)  # DVC outputs, cached or not


def _covered(stage, path: str) -> bool:
    deps = stage_deps(stage)
    return path in deps or any(path.startswith(d.rstrip("/") + "/") for d in deps if "${" not in d)


def test_code_deps_are_the_import_closure_of_the_stage_module():
    """Every project file a stage's module imports, at module level or inside a function, is one of its deps."""
    from rlhfops.codedeps import import_closure

    for s in STAGES:
        closure = import_closure(s.module)
        assert f"tasks/{s.name}.py" in closure and "rlhfops/stage_runner.py" in closure
        missing = [f for f in closure if not _covered(s, f)]
        assert not missing, f"{s.name}: imports {missing}, which are not among its deps"
    sft = next(s for s in STAGES if s.name == "sft")
    assert {"rlhflow/evaluation/metrics.py", "rlhflow/models/packed_linear.py"} <= set(stage_deps(sft))
    ppo = next(s for s in STAGES if s.name == "ppo")
    assert all(
        _covered(ppo, f)
        for f in (
            "rlhflow/models/packed_linear.py",
            "rlhflow/models/loading.py",
            "rlhflow/training/distributed.py",
            "rlhflow/training/reward_model.py",
            "rlhflow/ppo/trainer.py",
        )
    )


# Imports each stage module in turn in one process, forgetting the project's modules between them (the stack, once
# loaded, stays): per stage, the project files that importing it ran, as JSON lines.
CODE_DEPS_PROBE = """
import importlib, json, sys
root = sys.argv[1]
for module in sys.argv[2:]:
    for name in [n for n in sys.modules if n.split(".")[0] in ("rlhflow", "rlhfops", "tasks")]:
        del sys.modules[name]
    importlib.import_module(module)
    files = [m.__file__ for m in list(sys.modules.values()) if getattr(m, "__file__", None)]
    print(json.dumps([f for f in files if f.startswith(root + "/") and "/.venv/" not in f]))
"""


@pytest.mark.system
def test_code_deps_cover_what_importing_the_module_loads():
    """An independent check of the static walk: the project modules that importing each stage's module actually
    loads (module-level imports; the walk also sees the deferred ones) are among its deps."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run(
        [sys.executable, "-c", CODE_DEPS_PROBE, str(REPO_ROOT), *(s.module for s in STAGES)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    reports = out.stdout.strip().splitlines()
    assert len(reports) == len(STAGES), out.stdout[-2000:]
    for s, report in zip(STAGES, reports):
        loaded = {str(Path(f).resolve().relative_to(REPO_ROOT)) for f in json.loads(report)}
        assert loaded, s.name
        assert not [f for f in loaded if not _covered(s, f)], s.name


def test_the_import_walk_follows_deferred_and_relative_imports(tmp_path):
    from rlhfops.codedeps import import_closure

    (tmp_path / "tasks").mkdir()
    (tmp_path / "rlhflow/sub").mkdir(parents=True)
    for f in (
        "tasks/__init__.py",
        "rlhflow/__init__.py",
        "rlhflow/sub/__init__.py",
        "rlhflow/leaf.py",
        "rlhflow/unused.py",
    ):
        (tmp_path / f).write_text("")
    (tmp_path / "rlhflow/sub/mod.py").write_text("from ..leaf import x\nfrom . import sibling\n")
    (tmp_path / "rlhflow/sub/sibling.py").write_text("import json\n")
    (tmp_path / "tasks/st.py").write_text("import os\n\ndef run():\n    from rlhflow.sub.mod import thing\n")
    assert import_closure("tasks.st", tmp_path) == (
        "rlhflow/__init__.py",
        "rlhflow/leaf.py",
        "rlhflow/sub/__init__.py",
        "rlhflow/sub/mod.py",
        "rlhflow/sub/sibling.py",
        "tasks/__init__.py",
        "tasks/st.py",
    )
