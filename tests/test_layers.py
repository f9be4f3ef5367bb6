"""The tree read as layers: each folder imports only from the layers below it, wherever the import is (module
level or inside a function), and no file grows past 600 lines.

    flows/, bench/          the Prefect flows and the benchmarks: may import everything below
    tasks/                  one module per stage (plus the body two stages share): rlhfops, rlhflow
    rlhfops/                the pipeline machinery (stage list, lineage, tracking, registry, serving): rlhflow
    rlhflow/                the ML library: nothing of the project above it
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = ["rlhflow", "rlhfops", "tasks", "flows"]  # lowest first; bench sits beside flows
ABOVE = {name: set(LAYERS[i + 1 :]) | {"bench", "tests"} for i, name in enumerate(LAYERS)}
MAX_LINES = 600


def project_files(*folders: str) -> list[Path]:
    return sorted(p for d in folders for p in (REPO / d).rglob("*.py") if "__pycache__" not in p.parts)


def imported_top_levels(path: Path) -> dict[str, int]:
    """The top-level package of every absolute import in the file -> the first line importing it."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            found.setdefault(name.split(".")[0], node.lineno)
    return found


@pytest.mark.parametrize("layer", ["rlhflow", "rlhfops", "tasks"])
def test_no_module_imports_a_layer_above_its_own(layer):
    wrong = [
        f"{path.relative_to(REPO)}:{line} imports {top}"
        for path in project_files(layer)
        for top, line in imported_top_levels(path).items()
        if top in ABOVE[layer]
    ]
    assert not wrong, wrong


def test_the_ml_library_knows_nothing_of_the_orchestration_stack():
    """rlhflow runs without Prefect, DVC or MLflow: tracking and recording are the machinery's."""
    wrong = [
        f"{path.relative_to(REPO)}:{line} imports {top}"
        for path in project_files("rlhflow")
        for top, line in imported_top_levels(path).items()
        if top in {"prefect", "dvc", "dvc_data", "mlflow"}
    ]
    assert not wrong, wrong


def test_no_stage_module_imports_another_stage():
    stage_modules = {p.stem for p in project_files("tasks")} - {"__init__", "pairwise_training"}
    wrong = []
    for path in project_files("tasks"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tasks."):
                if node.module.split(".")[1] in stage_modules:
                    wrong.append(f"{path.relative_to(REPO)}:{node.lineno} imports {node.module}")
    assert not wrong, wrong


def test_test_fixtures_live_with_the_tests():
    assert not (REPO / "rlhflow" / "testing.py").exists()
    assert (REPO / "tests" / "fixtures.py").is_file()


def test_no_file_over_600_lines():
    long = {
        str(p.relative_to(REPO)): n
        for p in project_files("rlhflow", "rlhfops", "tasks", "flows", "bench")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def test_every_project_import_resolves():
    """Imports inside functions run only when the function does: check each `from <project module> import name`
    names something that module defines, so a moved function cannot leave a stage that fails at run time."""
    import importlib

    wrong = []
    for path in project_files("rlhflow", "rlhfops", "tasks", "flows", "bench"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                continue
            if node.module.split(".")[0] not in {"rlhflow", "rlhfops", "tasks", "flows", "bench"}:
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        wrong.append(f"{path.relative_to(REPO)}:{node.lineno} {node.module}.{alias.name}")
    assert not wrong, wrong
