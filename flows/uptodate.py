"""Is a stage up to date? The flow's answer is DVC's: a stage is skipped when the DVC md5 of each of its deps
(data, upstream outputs and its code, as listed in rlhflow/stages.py, hence in dvc.yaml), the values of its
params.yaml sections and the md5 of each of its outputs equal those recorded after its last successful run.

The record of a run has the shape of a dvc.lock entry. It is kept in `<metrics_dir>/.flow/flow.lock` (written
by the flow) and the repository's own dvc.lock (written by `dvc repro`) is accepted too, so a stage that
`dvc repro` just ran is not run again by the flow. Hashes are DVC's own (dvc-data's `build`, md5 of a file,
`<md5>.dir` of a directory listing), cached by inode/mtime/size in `<metrics_dir>/.flow/hash-state` the way
DVC caches them, so unchanged multi-GB model dirs are not re-read.

The params compared are those of the run's config (params.yaml plus `--set` overrides or the Prefect form),
so a second run with the same overrides skips too; DVC itself only knows params.yaml.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rlhflow.config import REPO_ROOT, Config
from rlhflow.fsutil import atomic_file
from rlhflow.stages import Stage

PARAMS_FILE = "params.yaml"  # the key dvc.lock files its params under


@dataclass(frozen=True)
class Fingerprint:
    """What decides whether a stage must run: path -> DVC md5 of deps and outs (None: missing), param values."""

    deps: dict[str, str | None]
    params: dict[str, Any]
    outs: dict[str, str | None]

    def to_lock_entry(self, stage: Stage) -> dict[str, Any]:
        return {"cmd": f"python -m {stage.module}",
                "deps": [{"path": p, "md5": h} for p, h in self.deps.items()],
                "params": {PARAMS_FILE: self.params},
                "outs": [{"path": p, "md5": h} for p, h in self.outs.items()]}

    @classmethod
    def from_lock_entry(cls, entry: dict[str, Any]) -> Fingerprint:
        return cls(deps={d["path"]: d.get("md5") for d in entry.get("deps", [])},
                   params=dict(entry.get("params", {}).get(PARAMS_FILE, {})),
                   outs={o["path"]: o.get("md5") for o in entry.get("outs", [])})


def state_dir(cfg: Config) -> Path:
    return cfg.path(cfg.metrics_dir) / ".flow"


def flow_lock_path(cfg: Config) -> Path:
    return state_dir(cfg) / "flow.lock"


def stage_params(stage: Stage, cfg: Config) -> dict[str, Any]:
    """The stage's params as dvc.lock records them: a section's whole dict, a dotted key's single value."""
    params = cfg.to_params()
    values: dict[str, Any] = {}
    for key in stage.params:
        node: Any = params
        for part in key.split("."):
            node = node[part]
        values[key] = node
    return values


def stage_outputs(stage: Stage) -> list[str]:
    return [*stage.outs, *stage.metrics, *stage.plots]


@contextlib.contextmanager
def _hasher(cfg: Config) -> Iterator[Any]:
    """`md5(path)`: DVC's hash of a file or directory, None when it does not exist."""
    from dvc_data.hashfile.build import build
    from dvc_data.hashfile.db import HashFileDB
    from dvc_data.hashfile.state import State
    from dvc.ignore import DvcIgnoreFilter
    from dvc_objects.fs import LocalFileSystem

    fs = LocalFileSystem()
    ignore = DvcIgnoreFilter(fs, str(REPO_ROOT))  # .dvcignore, as `dvc repro` applies it
    cache_dir = state_dir(cfg) / "hash-state"
    cache_dir.mkdir(parents=True, exist_ok=True)
    state = State(root_dir=str(REPO_ROOT), tmp_dir=str(cache_dir))
    try:
        with tempfile.TemporaryDirectory() as odb_dir:
            odb = HashFileDB(fs, odb_dir, state=state)

            def md5(path: Path) -> str | None:
                if not path.exists():
                    return None
                _, _, obj = build(odb, str(path), fs, "md5", dry_run=True, ignore=ignore)
                return obj.hash_info.value

            yield md5
    finally:
        state.close()


def fingerprint(stage: Stage, cfg: Config) -> Fingerprint:
    """The stage's deps, params and outs now, with paths as dvc.yaml resolves them (relative to the repo)."""
    with _hasher(cfg) as md5:
        deps = {p: md5(cfg.path(p)) for p in (stage.resolve(cfg, t) for t in stage.deps)}
        outs = {p: md5(cfg.path(p)) for p in (stage.resolve(cfg, t) for t in stage_outputs(stage))}
    return Fingerprint(deps=deps, params=stage_params(stage, cfg), outs=outs)


def _read_lock(path: Path) -> dict[str, Any]:
    try:
        return (yaml.safe_load(path.read_text()) or {}).get("stages", {})
    except (OSError, yaml.YAMLError):
        return {}  # no record (or an unreadable one): the stage runs


def recorded(stage: Stage, cfg: Config) -> list[tuple[str, Fingerprint]]:
    """The recorded fingerprints of the stage: the flow's lock, then the repo's dvc.lock."""
    found = []
    for source, path in (("flow.lock", flow_lock_path(cfg)), ("dvc.lock", REPO_ROOT / "dvc.lock")):
        entry = _read_lock(path).get(stage.name)
        if entry:
            found.append((source, Fingerprint.from_lock_entry(entry)))
    return found


def _differences(now: Fingerprint, then: Fingerprint) -> list[str]:
    why = []
    for path, md5 in now.deps.items():
        if md5 is None:
            why.append(f"dep {path} is missing")
        elif then.deps.get(path) != md5:
            why.append(f"dep {path} changed")
    for key, value in now.params.items():
        if key not in then.params or then.params[key] != value:
            why.append(f"params {key} changed")
    for path, md5 in now.outs.items():
        if md5 is None:
            why.append(f"output {path} is missing")
        elif then.outs.get(path) != md5:
            why.append(f"output {path} changed")
    if set(then.deps) != set(now.deps) or set(then.outs) != set(now.outs):
        why.append("the stage's deps or outputs differ from the record (stage definition changed)")
    return why


def why_stale(stage: Stage, cfg: Config, now: Fingerprint | None = None) -> list[str]:
    """Empty when the stage is up to date; otherwise the reasons it must run (first differing record)."""
    now = now or fingerprint(stage, cfg)
    records = recorded(stage, cfg)
    if not records:
        missing = [f"output {p} is missing" for p, h in now.outs.items() if h is None]
        return missing or ["no record of a previous successful run"]
    reasons: list[str] = []
    for _source, then in records:
        diff = _differences(now, then)
        if not diff:
            return []
        reasons = reasons or diff
    return reasons


def record_run(stage: Stage, cfg: Config) -> Fingerprint:
    """After a successful run: record the stage's fingerprint in the flow's lock (atomically)."""
    now = fingerprint(stage, cfg)
    path = flow_lock_path(cfg)
    data = {"schema": "2.0", "stages": _read_lock(path)}
    data["stages"][stage.name] = now.to_lock_entry(stage)
    with atomic_file(path) as f:
        yaml.safe_dump(data, f, sort_keys=False)
    return now
