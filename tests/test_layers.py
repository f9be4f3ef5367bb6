"""The tree read as layers: each folder imports only from the layers below it, wherever the import is (module
level or inside a function), and no file grows past 600 lines.

    flows/, bench/          the Prefect flows and the benchmarks: may import everything below
    tasks/                  one module per stage (plus the body two stages share): rlhfops, rlhflow
    rlhfops/                the pipeline machinery (stage list, lineage, tracking, registry, serving): rlhflow
    rlhflow/                the ML library: nothing of the project above it

Inside rlhflow, rooms by job, each importing only the rooms before it in ROOMS (and the base modules below them all),
and no circle of imports anywhere in the project; no function longer than a screen (60 lines); imports at the top of
their module, except heavy optional ones (DEFERRED_IMPORTS) and, in the doors (DOORS: the modules a command starts),
the stack and the project modules that load it, which a door imports where its work needs them (tests/test_doors.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = ["rlhflow", "rlhfops", "tasks", "flows"]  # lowest first; bench sits beside flows
ABOVE = {name: set(LAYERS[i + 1 :]) | {"bench", "tests"} for i, name in enumerate(LAYERS)}
MAX_LINES = 600
ROOMS = ["config", "data", "models", "training", "ppo", "evaluation"]  # rlhflow's rooms, lowest first
BASE = {"fsutil", "progress", "redaction"}  # rlhflow's top-level modules, below every room
PROJECT = ["rlhflow", "rlhfops", "tasks", "flows", "bench"]


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
    stage_modules = {p.stem for p in project_files("tasks")} - {"__init__", "pairwise_training", "evaluation_setup"}
    wrong = []
    for path in project_files("tasks"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tasks."):
                if node.module.split(".")[1] in stage_modules:
                    wrong.append(f"{path.relative_to(REPO)}:{node.lineno} imports {node.module}")
    assert not wrong, wrong


def config_takers(path: Path) -> list[str]:
    """The functions in `path` that take a Config (annotated as one)."""
    takers = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            if any(ast.unparse(a.annotation).strip("'\"") == "Config" for a in args if a.annotation):
                takers.append(node.name)
    return takers


def test_the_evaluating_stages_read_the_config_in_one_place():
    """evaluate and sft_answers hand the configuration to `evaluation_inputs` alone (tasks/evaluation_setup.py) and
    work on its values: only their `run` takes the Config, and in evaluation_setup only the readers of it do."""
    for stage in ("evaluate", "sft_answers"):
        assert config_takers(REPO / "tasks" / f"{stage}.py") == ["run"], stage
    readers = {"evaluation_inputs", "evaluation_settings", "evaluation_sampling"}
    assert set(config_takers(REPO / "tasks" / "evaluation_setup.py")) == readers


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


MAX_FUNCTION_LINES = 60  # one screen


def test_no_function_longer_than_a_screen():
    long = [
        f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in project_files("rlhflow", "rlhfops", "tasks", "flows")
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, long


# Imported inside the functions that use them: heavy, and needed by few runs. Each module that defers one names it
# (as spelled here, or as the package it belongs to) in a comment.
DEFERRED_IMPORTS = {
    "accelerate": "accelerate",
    "boto3": "boto3",
    "botocore": "boto3",
    "datasets": "datasets",
    "dvc": "dvc",
    "dvc_data": "dvc",
    "dvc_objects": "dvc",
    "great_expectations": "great_expectations",
    "httpx": "httpx",
    "matplotlib": "matplotlib",
    "peft": "peft",
    "playwright": "playwright",  # a contributor's pictures (flows/docs_images.py); a dev dependency
    "prefect.server": "Prefect's server",
    "psutil": "psutil",
    "pyarrow": "pyarrow",
    "sklearn": "scikit-learn",
    "transformers.trainer_callback": "transformers' Trainer",  # it loads peft: stages that only score skip it
    "transformers.trainer": "transformers' Trainer",
    "transformers.modeling_gguf_pytorch_utils": "gguf",
    "trl": "trl",
    "torch": "torch",
    "urllib3": "urllib3",  # only rlhflow/training/distributed.py: which process this is needs no torch
}

# The modules a command starts (a stage, a flow, a CLI of the machinery) and the two a flow's command imports at its
# top (the temporary server and the training slot, which load Prefect when used). Each says "light door" in a
# comment and imports the stack (bench/doors.py HEAVY) and the project's own modules inside the functions that need
# them, so that its --help and its checks answer before any of the stack loads (the import closure that decides a
# stage's DVC deps sees those imports too: rlhfops/codedeps.py).
DOORS = (
    "tasks",
    "flows",
    "rlhfops/stage_runner.py",
    "rlhfops/launch.py",
    "rlhfops/labeling.py",
    "rlhfops/stack.py",
    "rlhfops/dvc_yaml.py",
    "rlhfops/temporary_server.py",
    "rlhfops/training_slot.py",
)


def is_door(path: Path) -> bool:
    rel = path.relative_to(REPO).as_posix()
    return any(rel == door or rel.startswith(door + "/") for door in DOORS)


def door_may_defer(name: str) -> bool:
    from bench.doors import HEAVY

    top = name.lstrip(".").split(".")[0]
    return name.startswith(".") or top in HEAVY or top in PROJECT


def deferred_as(name: str) -> str | None:
    """How a module's comment names `name` when it may be imported inside a function, else None."""
    for prefix, named in DEFERRED_IMPORTS.items():
        if name == prefix or name.startswith(prefix + "."):
            return named
    return None


def test_imports_sit_at_the_top_of_their_module():
    """Every import at the top of its module, where a reader sees what the module depends on, except the heavy
    optional ones (DEFERRED_IMPORTS), which its comments name, and what a door (DOORS) defers."""
    wrong = []
    for path in project_files("rlhflow", "rlhfops", "tasks", "flows"):
        text = path.read_text()
        comments = " ".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
        for function in ast.walk(ast.parse(text, str(path))):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    module = node.names[0].name if isinstance(node, ast.Import) else node.module or ""
                    name = "." * getattr(node, "level", 0) + module
                    if is_door(path) and "light door" in comments and door_may_defer(name):
                        continue
                    named = deferred_as(name)
                    if named is None or named not in comments:
                        wrong.append(f"{path.relative_to(REPO)}:{node.lineno} {function.name} imports {name}")
    assert not wrong, wrong


def test_no_library_function_takes_the_whole_config():
    """A stage reads its sections once and hands the library values (docs/configuration.md): outside the config
    room, rlhflow neither imports the Config nor takes one."""
    wrong = []
    for path in project_files("rlhflow"):
        if path.parent.name == "config":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and any(a.name == "Config" for a in node.names):
                wrong.append(f"{path.relative_to(REPO)}:{node.lineno} imports Config")
        wrong += [f"{path.relative_to(REPO)}: {name} takes a Config" for name in config_takers(path)]
    assert not wrong, wrong


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


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, dict[str, int]]:
    """Each project module -> the project modules it imports (anywhere in the file) -> the first line importing it.
    `from a.b import c` counts as importing the module a.b.c when there is one, else a.b."""
    modules = {module_name(p): p for p in project_files(*PROJECT)}
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                if target in modules and target != name:
                    found.setdefault(target, node.lineno)
        graph[name] = found
    return graph


def room_of(module: str) -> str:
    """rlhflow.models.policy -> models; rlhflow.fsutil -> fsutil (a base module); rlhflow -> the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "rlhflow"


def test_the_library_is_in_rooms():
    top_modules = {p.stem for p in (REPO / "rlhflow").glob("*.py")} - {"__init__"}
    folders = {p.name for p in (REPO / "rlhflow").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert top_modules == BASE and len(top_modules) <= 3, top_modules
    assert folders == set(ROOMS), folders


def test_each_room_imports_only_the_rooms_below_it():
    wrong = []
    for module, imports in import_graph().items():
        if not module.startswith("rlhflow."):
            continue
        room = room_of(module)
        for target, line in imports.items():
            to = room_of(target)
            if to == room or to in BASE and room not in BASE:
                continue
            if room in BASE or to not in ROOMS or ROOMS.index(to) > ROOMS.index(room):
                wrong.append(f"{module}:{line} ({room}) imports {target} ({to})")
    assert not wrong, wrong


def test_no_circle_of_imports():
    """Tarjan's strongly connected components of the import graph: every one a single module."""
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not circles, circles
