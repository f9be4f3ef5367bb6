"""Where outputs and checkpoints may go: checked when the config loads (rlhflow.config.params.Config), before any stage
runs. A stage replaces its output directory whole and deletes its checkpoint directory when done, so a setting
that points one at the repository root, a directory above it, the home directory, the data the repository ships
or another stage's output would cost files the pipeline did not write."""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

# Every setting naming a directory a stage writes (replaced whole, or deleted once the stage is done).
OUTPUT_SETTINGS = (
    "data.demo.out_dir",
    "validate.out_dir",
    "validate.report_dir",
    "sft.out_dir",
    "sft.checkpoint_dir",
    "reward_model.out_dir",
    "reward_model.checkpoint_dir",
    "judge.out_dir",
    "judge.checkpoint_dir",
    "ppo.out_dir",
    "ppo.checkpoint_dir",
    "evaluate.reference_dir",
    "evaluate.report_dir",
    "metrics_dir",
)
# Settings whose directory is written file by file (metrics/<stage>.json), never replaced or deleted whole: a project
# commits those files to git (as DVC's get-started does), so the directory may hold tracked files, but it may not be
# a tracked file itself or lie over the shipped data.
FILEWISE_SETTINGS = frozenset({"metrics_dir"})
# The data the repository ships (data/README.md), protected where git cannot list the tracked files (an image
# without .git); tests/test_safe_paths.py checks it covers every file git tracks under data/.
SHIPPED_DATA = ("data/README.md", "data/feedback", "data/hh-rlhf-harmless", "data/llamafactory-dpo-en")


@functools.cache
def shipped_paths(root: Path) -> frozenset[str]:
    """Repository-relative paths of every file the repository at `root` ships (tracked by git), of every directory
    above one, and .git; without git, those of SHIPPED_DATA."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True, timeout=60
        ).stdout
        files = [f for f in os.fsdecode(listed).split("\0") if f]
    except (OSError, subprocess.SubprocessError):  # no git, no repository, a repository of another owner
        files = []
    paths = set()
    for file in [*(files or SHIPPED_DATA), ".git"]:
        parts = PurePosixPath(file).parts
        paths.update("/".join(parts[: i + 1]) for i in range(len(parts)))
    return frozenset(paths)


def _is_at_or_above(path: Path, place: Path) -> bool:
    return place.parts[: len(path.parts)] == path.parts


def _overlaps(a: Path, b: Path) -> bool:
    return _is_at_or_above(a, b) or _is_at_or_above(b, a)


def output_path_problem(path: Path, repo_roots: list[Path], home: Path, *, filewise: bool = False) -> str | None:
    """Why an output or checkpoint directory may not be at `path` (absolute, resolved), or None. `filewise`: the
    directory is written file by file (FILEWISE_SETTINGS), so only a tracked file or the shipped data is refused."""
    for root in repo_roots:
        if _is_at_or_above(path, root):
            return f"the repository root {root}" if path == root else f"a directory above the repository {root}"
    if _is_at_or_above(path, home):
        return f"the home directory {home}" if path == home else f"a directory above the home directory {home}"
    for root in repo_roots:
        rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else None
        if rel is None:
            continue
        if filewise and (root / rel).is_file() and rel in shipped_paths(root):
            return f"a file the repository {root} ships"
        if filewise and any(_overlaps(PurePosixPath(rel), PurePosixPath(data)) for data in SHIPPED_DATA):
            return f"the data the repository {root} ships"
        if not filewise and rel in shipped_paths(root):
            return f"a path the repository {root} ships or that holds files it ships (its data, its code)"
    return None


def check_output_paths(values: dict[str, Any], resolve: Callable[[str], Path], repo_roots: list[Path]) -> None:
    """Raise ValueError naming the setting and its path when an output or checkpoint setting resolves to the
    repository (the workspace, and the project around a DVC experiment's temporary copy) or a directory above it,
    the home directory or one above it, a path holding shipped files, or the path of another such setting (the same,
    or one inside the other). `values`: the config as params.yaml holds it; `resolve`: Config.path; `repo_roots`:
    the workspace and the project it belongs to (rlhflow.config.params.project_root)."""
    repo_roots = list(dict.fromkeys(p.resolve() for p in repo_roots))
    home = Path(os.path.expanduser("~")).resolve()
    resolved: dict[str, Path] = {}
    for key in OUTPUT_SETTINGS:
        value: Any = values
        for part in key.split("."):
            value = value[part]
        path = resolve(value).resolve()
        problem = output_path_problem(path, repo_roots, home, filewise=key in FILEWISE_SETTINGS)
        if problem:
            raise ValueError(
                f"{key}={value}: resolves to {path}, {problem}; the stage replaces or deletes this directory, so "
                "it would destroy files the pipeline did not write. Point it at a directory of its own."
            )
        clash = next((other for other, p in resolved.items() if _overlaps(path, p)), None)
        if clash:
            raise ValueError(
                f"{key}={value}: resolves to {path}, which is or holds or lies inside {clash}={resolved[clash]}; "
                "each stage output and checkpoint directory needs a path of its own."
            )
        resolved[key] = path


# ---- every path a setting names lies inside the project -------------------------------------------------------------

# Settings naming files the pipeline writes besides OUTPUT_SETTINGS' directories: appended to, created
WRITTEN_FILE_SETTINGS = ("feedback.pairs_file", "feedback.labels_file")
# Settings naming what the pipeline reads: data, a template, a model (a local path; a package or Hub id is no path)
READ_SETTINGS = (
    "data.preferences",
    "data.test_preferences",
    "sft.train_data",
    "sft.model",
    "reward_model.backbone",
    "judge.backbone",
    "judge.model",
    "judge.template",
)
# The environment's list (os.pathsep-separated) of directories outside the project that settings may name: what a
# params file or a Prefect parameter names cannot reach beyond the project without the machine's owner saying so
ALLOW_PATHS = "RLHFLOW_ALLOW_PATHS"
NOT_PATHS = ("pkg:", "sft")  # a packaged model; the SFT model as a backbone


def allowed_dirs(environ: dict[str, str] | None = None) -> list[Path]:
    """The directories $RLHFLOW_ALLOW_PATHS names (absolute ones, links resolved)."""
    listed = (os.environ if environ is None else environ).get(ALLOW_PATHS, "")
    dirs = [Path(os.path.expanduser(d)) for d in listed.split(os.pathsep) if d.strip()]
    return [d.resolve() for d in dirs if d.is_absolute()]


def _names_a_path(value: str, path: Path) -> bool:
    """Whether a read setting's value is a local path (not a package or a Hub id): absolute, ~ or . or .. in it, or
    something there."""
    if value.startswith(NOT_PATHS[0]) or value == NOT_PATHS[1]:
        return False
    parts = Path(value).parts
    return Path(value).is_absolute() or value.startswith(("~", ".")) or ".." in parts or path.exists()


def check_inside_project(values: dict[str, Any], resolve: Callable[[str], Path], repo_roots: list[Path]) -> None:
    """Raise ValueError naming the setting, its value and where it resolves (links followed) when a path a setting
    names lies outside the project (`repo_roots`) and every directory $RLHFLOW_ALLOW_PATHS names."""
    inside = [*dict.fromkeys(p.resolve() for p in repo_roots), *allowed_dirs()]
    for key in (*OUTPUT_SETTINGS, *WRITTEN_FILE_SETTINGS, *READ_SETTINGS):
        value: Any = values
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if not isinstance(value, str) or not value:
            continue
        path = resolve(value)
        if key in READ_SETTINGS and not _names_a_path(value, path):
            continue
        real = path.resolve()
        if not any(real == d or real.is_relative_to(d) for d in inside):
            raise ValueError(
                f"{key}={value}: resolves to {real}, outside the project {inside[0]}: the paths settings name lie "
                "inside the project, so a params file or a Prefect parameter cannot make a run read or write "
                f"elsewhere. To use a directory outside it, name it in the command's environment: "
                f"{ALLOW_PATHS}=/data/mine python -m flows.pipeline ..."
            )
