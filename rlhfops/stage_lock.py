"""A stage's lock entry: is the stage up to date (`why_stale`), and its record once it ran (`record_run`).

DVC decides and records: the stage is DVC's own object (dvc.yaml and dvc.lock), `why_stale` asks it `changed()` as
`dvc repro` does, and `record_run` saves, commits and dumps its lock entry as `dvc repro` does after the command,
with the param values of the run's config (`_params_from_config`: params.yaml plus overrides). DVC's repository
lock is held only while checking and recording. Where DVC cannot record (no DVC project, or an override moved an
output), the flow keeps a dvc.lock-shaped record of its own in `<metrics_dir>/.flow/flow.lock`, with DVC's hashes.
The whole story: docs/lineage.md.
"""

from __future__ import annotations

# dvc is heavy: it is imported inside the functions that use it, so importing the flow stays fast.
import contextlib
import logging
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from ruamel.yaml.error import YAMLError

from rlhflow.config.params import REPO_ROOT, Config, load_config
from rlhflow.fsutil import atomic_file
from rlhfops.dvc_yaml import stage_deps
from rlhfops.hashing import dvc_md5s
from rlhfops.stages import STAGES, Stage

PARAMS_FILE = "params.yaml"  # the key dvc.lock files its params under


# ---- the flow's own record, where DVC cannot stand for a run (see the module docstring) -------------------------


@dataclass(frozen=True)
class Fingerprint:
    """What decides whether a stage must run: path -> DVC md5 of deps and outs (None: missing), param values."""

    deps: dict[str, str | None]
    params: dict[str, Any]
    outs: dict[str, str | None]

    def to_lock_entry(self, stage: Stage) -> dict[str, Any]:
        return {
            "cmd": stage.command,
            # `hash: md5` as DVC 3 writes it; without it DVC reads the md5 as a 2.x one and looks in the old cache
            "deps": [{"path": p, "hash": "md5", "md5": h} for p, h in self.deps.items()],
            "params": {PARAMS_FILE: self.params},
            "outs": [{"path": p, "hash": "md5", "md5": h} for p, h in self.outs.items()],
        }

    @classmethod
    def from_lock_entry(cls, entry: dict[str, Any]) -> Fingerprint:
        return cls(
            deps={d["path"]: d.get("md5") for d in entry.get("deps", [])},
            params=dict(entry.get("params", {}).get(PARAMS_FILE, {})),
            outs={o["path"]: o.get("md5") for o in entry.get("outs", [])},
        )


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


def fingerprint(stage: Stage, cfg: Config) -> Fingerprint:
    """The stage's deps, params and outs now, with paths as dvc.yaml resolves them (relative to the repo)."""
    with dvc_md5s(state_dir(cfg)) as md5:
        deps = {p: md5(cfg.path(p)) for p in (stage.resolve(cfg, t) for t in stage_deps(stage))}
        outs = {p: md5(cfg.path(p)) for p in (stage.resolve(cfg, t) for t in stage_outputs(stage))}
    return Fingerprint(deps=deps, params=stage_params(stage, cfg), outs=outs)


def load_lock(text: str) -> dict[str, Any]:
    """A lock file's content, read as DVC reads it (YAML 1.2: `2e-05` is a float, where PyYAML reads a string)."""
    from dvc.utils.serialize import loads_yaml

    return loads_yaml(text) or {}


def _read_lock(path: Path) -> dict[str, Any]:
    try:
        return load_lock(path.read_text()).get("stages", {})
    except (OSError, YAMLError):
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


def why_stale_flow_lock(stage: Stage, cfg: Config, now: Fingerprint | None = None) -> list[str]:
    """Without DVC: empty when the stage is up to date; otherwise the reasons it must run (first differing
    record of flow.lock, then dvc.lock)."""
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


def record_flow_lock(stage: Stage, cfg: Config) -> Fingerprint:
    """Without DVC, after a successful run: record the stage's fingerprint in the flow's lock (atomically)."""
    now = fingerprint(stage, cfg)
    path = flow_lock_path(cfg)
    data = {"schema": "2.0", "stages": _read_lock(path)}
    data["stages"][stage.name] = now.to_lock_entry(stage)
    with atomic_file(path) as f:
        yaml.safe_dump(data, f, sort_keys=False)
    return now


# ---- DVC: its own stage objects decide and record ---------------------------------------------------------------

LOCK_FILE = "dvc.lock"


def is_dvc_project(root: Path = REPO_ROOT) -> bool:
    return (root / ".dvc").is_dir() and (root / "dvc.yaml").is_file()


def in_git_work_tree(root: Path = REPO_ROOT) -> bool:
    """Whether `root` is inside a git work tree (a `.git` in it or above it)."""
    return any((d / ".git").exists() for d in (root.resolve(), *root.resolve().parents))


_told_no_git: set[str] = set()


@contextlib.contextmanager
def dvc_repo(root: Path = REPO_ROOT) -> Iterator[Any]:
    """DVC's Repo at `root`. Outside a git work tree (a release archive, the Docker image) DVC runs without git
    (`core.no_scm`): stages, lock entries and the cache work as in a clone; what needs git (experiments, the git
    commit on records) is left out, said once per process."""
    from dvc.repo import Repo

    # importing dvc gave its loggers handlers of their own; passed on to the root logger as well, each line DVC says
    # ("Updating lock file 'dvc.lock'") came out twice under the flow, whose console handler sits there
    for name in ("dvc", "dvc_objects", "dvc_data"):
        logging.getLogger(name).propagate = False
    config = None
    if not in_git_work_tree(root):
        config = {"core": {"no_scm": True}}
        if str(root) not in _told_no_git:
            _told_no_git.add(str(root))
            print(
                f"{root} is not a git repository: DVC runs without git (core.no_scm); lock entries and the cache "
                "are recorded as usual, runs record no git commit",
                flush=True,
            )
    repo = Repo(str(root), config=config)
    try:
        yield repo
    finally:
        repo.close()


def declared_target(repo: Any, name: str) -> str:
    """Stage `name` of the repository's own dvc.yaml as a DVC target. A bare name means the dvc.yaml of the current
    directory, which is another project's when the process started elsewhere (a Prefect worker, a test)."""
    return f"{os.path.join(repo.root_dir, 'dvc.yaml')}:{name}"


def load_declared(repo: Any, name: str) -> Any:
    """DVC's stage `name` from the repository's own dvc.yaml (`declared_target`)."""
    return repo.stage.load_one(path=os.path.join(repo.root_dir, "dvc.yaml"), name=name)


@contextlib.contextmanager
def repo_lock(repo: Any) -> Iterator[None]:
    """DVC's repository lock (`.dvc/tmp/lock`), as DVC's own commands take it (re-entrant)."""
    from dvc.repo import lock_repo

    with lock_repo(repo):
        yield


def _abs(cfg: Config, path: str) -> str:
    return os.path.normpath(str(cfg.path(path)))


def _params_from_config(dstage: Any, stage: Stage, cfg: Config) -> None:
    """Make the stage's params.yaml dependency read the run's config instead of the file."""
    from dvc.dependency.param import ParamsDependency

    values = stage_params(stage, cfg)
    params_file = os.path.normpath(str(REPO_ROOT / PARAMS_FILE))
    for dep in dstage.deps:
        if isinstance(dep, ParamsDependency) and os.path.normpath(dep.fs_path) == params_file:
            keys = list(dep.params)

            def read_params(flatten: bool = True, _keys: list[str] = keys, **_: Any) -> dict[str, Any]:
                return {k: values[k] for k in _keys if k in values}

            dep.read_params = read_params


def where_params_file_puts_them(stage: Stage, cfg: Config) -> bool:
    """Whether `cfg` puts the stage's deps and outputs where params.yaml does. dvc.yaml's paths are templates DVC
    fills from params.yaml, so where an override moved one DVC cannot stand for the run, and its stage (dvc.yaml
    and dvc.lock, parsed at about a tenth of a second each) need not be loaded to find that out."""
    try:
        on_file = load_config(REPO_ROOT / PARAMS_FILE)
    except (OSError, ValueError, yaml.YAMLError):  # DVC's own loading decides, and says what is wrong
        return True
    templates = [*stage_deps(stage), *stage_outputs(stage)]
    return all(_abs(cfg, stage.resolve(cfg, t)) == _abs(on_file, stage.resolve(on_file, t)) for t in templates)


def dvc_may_stand(stage: Stage, cfg: Config) -> bool:
    """A DVC project whose dvc.yaml paths may be the config's: then `dvc_stage` decides."""
    return is_dvc_project() and where_params_file_puts_them(stage, cfg)


def dvc_stage(repo: Any, stage: Stage, cfg: Config) -> Any | None:
    """DVC's stage object for `stage` (dvc.yaml and dvc.lock), its params read from `cfg`; None when DVC cannot
    stand for this run: dvc.yaml has no such stage, or its deps and outputs are not the config's paths (an
    override moved one)."""
    from dvc.stage.exceptions import StageNotFound

    try:
        dstage = load_declared(repo, stage.name)
    except StageNotFound:
        return None
    from dvc.dependency.param import ParamsDependency

    have_deps = {os.path.normpath(d.fs_path) for d in dstage.deps if not isinstance(d, ParamsDependency)}
    have_outs = {os.path.normpath(o.fs_path) for o in dstage.outs}
    want_deps = {_abs(cfg, stage.resolve(cfg, t)) for t in stage_deps(stage)}
    want_outs = {_abs(cfg, stage.resolve(cfg, t)) for t in stage_outputs(stage)}
    if have_deps != want_deps or have_outs != want_outs:
        return None
    _params_from_config(dstage, stage, cfg)
    return dstage


@contextlib.contextmanager
def empty_inputs_unremarked(dstage: Any) -> Iterator[None]:
    """DVC says "'<path>' is empty." of every empty file it records. An empty input is a state the project ships (no
    pair of a feedback round yet: data/feedback/*.jsonl), not a problem: the remark stays for outputs only."""
    deps = {id(dep) for dep in dstage.deps}

    def keep(record: logging.LogRecord) -> bool:
        return not (record.msg == "'%s' is empty." and record.args and id(record.args[0]) in deps)

    said_by = logging.getLogger("dvc.output")
    said_by.addFilter(keep)
    try:
        yield
    finally:
        said_by.removeFilter(keep)


def _reasons(status: dict[str, Any]) -> list[str]:
    """DVC's stage status as sentences: `dep data/x modified`, `params validate modified`, `output y deleted`."""
    why = []
    for entries in status.values():
        for entry in entries:
            if isinstance(entry, str):
                why.append(entry)
                continue
            for kind, changes in entry.items():
                for path, state in changes.items():
                    if isinstance(state, dict):  # a params file: key -> state
                        why.extend(f"params {key} {st}" for key, st in state.items())
                    else:
                        why.append(f"{'dep' if kind == 'changed deps' else 'output'} {path} {state}")
    return why


def why_stale(stage: Stage, cfg: Config) -> list[str]:
    """Empty when the stage is up to date; otherwise why it must run. DVC's `changed()` decides when DVC can
    stand for the run (see the module docstring), the flow's own record otherwise."""
    if dvc_may_stand(stage, cfg):
        with dvc_repo() as repo:
            dstage = dvc_stage(repo, stage, cfg)
            if dstage is not None:
                with repo_lock(repo):
                    if not dstage.changed():  # what `dvc repro` asks
                        return []
                    return _reasons(dstage.status()) or ["changed"]
    return why_stale_flow_lock(stage, cfg)


def record_run(stage: Stage, cfg: Config) -> dict[str, Any]:
    """After the stage ran: its outputs into the DVC cache and its dvc.lock entry, as `dvc repro` leaves them
    (the flow's own record where DVC cannot stand for the run). Returns the lock entry."""
    if dvc_may_stand(stage, cfg):
        with dvc_repo() as repo:
            dstage = dvc_stage(repo, stage, cfg)
            if dstage is not None:
                from dvc.stage.serialize import to_lockfile

                with repo_lock(repo):
                    # as Stage.run after the command, then dvc.repo.reproduce._reproduce_stage
                    no_cache_outs = any(not o.use_cache for o in dstage.outs if not (o.is_metric or o.is_plot))
                    with empty_inputs_unremarked(dstage):
                        dstage.save(run_cache=not no_cache_outs)
                    dstage.commit()
                    dstage.dump(update_pipeline=False)
                    cache_paths(repo, [cfg.path(p) for p in user_data(stage, cfg)])
                return to_lockfile(dstage)[stage.name]
    entry = record_flow_lock(stage, cfg).to_lock_entry(stage)
    cached = [o["path"] for o in entry["outs"] if o["md5"] and not _uncached(stage, cfg, o["path"])]
    to_cache = [cfg.path(p) for p in [*cached, *user_data(stage, cfg)]] if is_dvc_project() else []
    if to_cache:  # DVC does not stand for the run, yet its outputs and data go into DVC's cache
        with dvc_repo() as repo, repo_lock(repo):
            cache_paths(repo, to_cache)
    return entry


def _uncached(stage: Stage, cfg: Config, path: str) -> bool:
    return path in {stage.resolve(cfg, t) for t in uncached_outputs(stage)}


def _tracked_bygit(path: Path) -> bool:
    """In the repository and in git. Without git (an exported tree) every file in the repository counts as the
    project's own: only files outside it are user data then."""

    try:
        rel = path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return False
    try:
        return bool(git("ls-files", "--", rel))
    except (OSError, subprocess.CalledProcessError):
        return True


def made_by_stages(cfg: Config) -> set[str]:
    return {os.path.normpath(s.resolve(cfg, t)) for s in STAGES for t in stage_outputs(s)}


def is_user_data(cfg: Config, rel: str, made: set[str]) -> bool:
    """The one rule for user data: a dep neither made by a stage (`made`) nor tracked by git."""
    return os.path.normpath(rel) not in made and not _tracked_bygit(cfg.path(rel))


def user_data(stage: Stage, cfg: Config) -> list[str]:
    """The stage's deps that only the user holds: files outside the repository, or in it but neither tracked by
    git nor made by a stage (a preference file passed as `data.preferences=/abs/path`). The flow copies them
    into the DVC cache, so a run stays restorable after the file changes."""
    made = made_by_stages(cfg)
    deps = [stage.resolve(cfg, template) for template in stage_deps(stage)]
    return [rel for rel in deps if cfg.path(rel).exists() and is_user_data(cfg, rel, made)]


def cache_paths(repo: Any, paths: list[Path]) -> None:
    """Copy files or directories into the repository's DVC cache (as `Output.commit` does, the workspace left
    as it is); objects already there are not copied again."""
    from dvc_data.hashfile.build import build
    from dvc_data.hashfile.transfer import transfer

    odb = repo.cache.local
    for path in paths:
        inside = Path(path).resolve().is_relative_to(REPO_ROOT)
        staging, _, obj = build(odb, str(path), repo.fs, "md5", ignore=repo.dvcignore if inside else None)
        transfer(staging, odb, {obj.hash_info}, shallow=False, hardlink=False)


def dvc_records(stage: Stage, cfg: Config) -> bool:
    """DVC stands for the stage in this config (its dvc.lock entry is the record), not the flow's own lock."""
    if not dvc_may_stand(stage, cfg):
        return False
    with dvc_repo() as repo:
        return dvc_stage(repo, stage, cfg) is not None


def lock_entry(stage: Stage, cfg: Config) -> dict[str, Any] | None:
    """The recorded entry that stands for the stage's outputs in this config: dvc.lock's where DVC stands for
    the run, else the flow's own."""
    path = REPO_ROOT / LOCK_FILE if dvc_records(stage, cfg) else flow_lock_path(cfg)
    return _read_lock(path).get(stage.name)


def uncached_outputs(stage: Stage) -> list[str]:
    """Outputs DVC keeps in git, not in its cache (metrics, plot data): the parent run keeps copies."""
    return [*stage.metrics, *stage.plots]


def git(*args: str, env: dict[str, str] | None = None, stdin: bytes | None = None) -> str:
    return (
        subprocess.run(
            ["git", *args],
            cwd=REPO_ROOT,
            env={**os.environ, **(env or {})},
            input=stdin,
            capture_output=True,
            check=True,
            timeout=60,
        )
        .stdout.decode()
        .strip()
    )
