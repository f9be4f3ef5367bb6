"""dvc.yaml, generated from the stage list (rlhfops/stages.py): `python -m rlhfops.dvc_yaml > dvc.yaml`.

Each stage's deps are the ones the stage list names plus every project file its module runs (rlhfops/codedeps.py),
so a change to code a stage runs makes it stale, for the flow and for `dvc repro` alike, and a change to code it
does not run leaves it up to date. The stages themselves never import this module: computing the closure is
`dvc.yaml`'s business and the flow's up-to-date check's (rlhfops/stage_lock.py), not a stage's.
"""

from __future__ import annotations

import argparse
import sys
from functools import cache
from typing import Any

import yaml

from rlhfops.codedeps import import_closure
from rlhfops.stages import PLOTS, STAGES, Stage


@cache
def _stage_deps(name: str, deps: tuple[str, ...], module: str) -> tuple[str, ...]:
    return tuple(with_code_deps(list(deps), module))


def stage_deps(stage: Stage) -> list[str]:
    """The stage's deps as dvc.yaml lists them: the named ones, then the project code its module runs."""
    return list(_stage_deps(stage.name, tuple(stage.deps), stage.module))


def with_code_deps(deps: list[str], module: str) -> list[str]:
    """The deps as listed (data, upstream outputs, code), then every project file the stage's module imports
    (rlhfops/codedeps.py), sorted; files inside a listed directory are covered by it."""
    listed = list(dict.fromkeys(deps))
    dirs = [d.rstrip("/") + "/" for d in listed if "${" not in d and not d.endswith(".py")]
    code = [f for f in import_closure(module) if f not in listed and not any(f.startswith(d) for d in dirs)]
    return listed + code


def dvc_yaml() -> str:
    """dvc.yaml, generated from STAGES."""
    stages: dict[str, Any] = {}
    for s in STAGES:
        entry: dict[str, Any] = {
            "desc": s.description,
            "cmd": s.command,
            "params": s.params,
            "deps": stage_deps(s),
            "outs": s.outs,
        }
        if s.metrics:
            entry["metrics"] = [{m: {"cache": False}} for m in s.metrics]
        if s.plots:
            entry["plots"] = [{p: {"cache": False}} for p in s.plots]
        stages[s.name] = entry
    header = "# Generated from rlhfops/stages.py by `python -m rlhfops.dvc_yaml > dvc.yaml`; do not edit by hand.\n"
    return header + yaml.safe_dump({"stages": stages, "plots": PLOTS}, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rlhfops.dvc_yaml", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.parse_args(argv)
    sys.stdout.write(dvc_yaml())


if __name__ == "__main__":
    main()
