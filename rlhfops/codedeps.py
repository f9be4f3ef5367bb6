"""The project code a module runs: the closure of its imports within the project's packages, found statically.

Every `import` and `from ... import` statement counts, wherever it is (module level, inside functions, under
`if TYPE_CHECKING:`), relative ones included; importing `a.b.c` runs `a/__init__.py` and `a/b/__init__.py` too,
so those count. Imports built at run time (`importlib.import_module(name)` with a computed name, such as a
user-supplied reward function) are not seen: they are data, not the stage's code.

This decides each stage's code deps in rlhfops/stages.py (hence dvc.yaml), so a change to any project file a
stage can run makes it stale, for the flow and for `dvc repro` alike.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT_PACKAGES = ("rlhflow", "rlhfops", "tasks")


def module_file(module: str, root: Path = ROOT) -> Path | None:
    """The project file defining `module` (a package's __init__.py), or None when it is not project code."""
    if module.split(".")[0] not in PROJECT_PACKAGES:
        return None
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _parents(module: str) -> list[str]:
    """`a.b.c` -> [a, a.b, a.b.c]: importing a module runs each enclosing package's __init__ first."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def imported_modules(path: Path, module: str) -> set[str]:
    """Every module named by an import statement in the file (absolute names; may include non-modules such as
    `a.b.func` from `from a.b import func`, which resolve to nothing)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.update(_parents(alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, up level-1 more
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            if not base:
                continue
            found.update(_parents(base))
            found.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return found


@cache
def import_closure(module: str, root: Path = ROOT) -> tuple[str, ...]:
    """Repo-relative paths (sorted) of the project files that importing `module` can run, itself included."""
    seen: dict[str, Path] = {}
    todo = _parents(module)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = module_file(name, root)
        if path is None:
            continue
        seen[name] = path
        todo.extend(m for m in imported_modules(path, name) if m not in seen)
    return tuple(sorted(p.relative_to(root).as_posix() for p in seen.values()))
