"""Lineage: is a stage up to date, what did a run produce, and how to put a run's outputs back.

DVC decides and records. When the repository is a DVC project and the flow's paths for a stage are the ones
dvc.yaml has for it (always, unless a `--set` override moved an output), the stage is DVC's own object
(`dvc.repo.Repo.stage.load_one`: dvc.yaml and dvc.lock) and

- `why_stale` asks it `changed()`, the very call `dvc repro` makes before running a stage;
- `record_run`, after the stage ran, does what `dvc repro` does after running its command: `save()` (hash deps
  and outputs, fill the run cache), `commit()` (outputs into the DVC cache) and `dump(update_pipeline=False)`
  (the stage's dvc.lock entry).

The one difference is where param values come from: the run's config (params.yaml plus `--set` overrides or the
Prefect form) instead of params.yaml alone (`_params_from_config`). Without overrides these are the values DVC
reads (a test checks it for every stage), so a flow run leaves `dvc status` clean and `dvc repro` a no-op. With
overrides, dvc.lock records the values the outputs were made with, exactly as `dvc exp run --set-param` would:
`dvc status` then says which params.yaml values differ, and the same overrides skip in the next flow run.
DVC's repository lock is held only while checking and recording, never while a stage trains.

Where DVC cannot record (no DVC project, or an override moved an output elsewhere, even outside the
repository), the flow keeps the same kind of record itself: a dvc.lock-shaped entry in
`<metrics_dir>/.flow/flow.lock`, with DVC's own hashes (dvc-data's `build`) of the same deps and outputs,
compared the same way. The repository's dvc.lock is accepted there too.

Every MLflow parent run carries the lock entries of its stages as the artifact `dvc.lock`, the resolved params as
`params.yaml` and the small uncached outputs (metrics, plot data) under `outputs/`; `restore` puts such a run's
outputs back from the DVC cache (or the default remote) and checks each md5 against that record. A run with
overrides is also saved as a DVC experiment (`save_experiment`), so `dvc exp show` lists its params and metrics.
"""

from __future__ import annotations

# dvc and mlflow are heavy: they are imported inside the functions that use them, so importing the flow stays fast.
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rlhflow import tracking
from rlhflow.config import REPO_ROOT, Config, load_config, write_params
from rlhflow.fsutil import atomic_file
from rlhflow.hashing import dvc_md5s
from rlhflow.stages import STAGES, Stage, get_stage
from rlhflow.tracking import redact  # URL passwords and secret environment values never reach MLflow

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
            "cmd": f"python -m {stage.module}",
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
        deps = {p: md5(cfg.path(p)) for p in (stage.resolve(cfg, t) for t in stage.deps)}
        outs = {p: md5(cfg.path(p)) for p in (stage.resolve(cfg, t) for t in stage_outputs(stage))}
    return Fingerprint(deps=deps, params=stage_params(stage, cfg), outs=outs)


def load_lock(text: str) -> dict[str, Any]:
    """A lock file's content, read as DVC reads it (YAML 1.2: `2e-05` is a float, where PyYAML reads a string)."""
    from dvc.utils.serialize import loads_yaml

    return loads_yaml(text) or {}


def _read_lock(path: Path) -> dict[str, Any]:
    from ruamel.yaml.error import YAMLError

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


@contextlib.contextmanager
def dvc_repo(root: Path = REPO_ROOT) -> Iterator[Any]:
    from dvc.repo import Repo

    repo = Repo(str(root))
    try:
        yield repo
    finally:
        repo.close()


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


def dvc_stage(repo: Any, stage: Stage, cfg: Config) -> Any | None:
    """DVC's stage object for `stage` (dvc.yaml and dvc.lock), its params read from `cfg`; None when DVC cannot
    stand for this run: dvc.yaml has no such stage, or its deps and outputs are not the config's paths (an
    override moved one)."""
    from dvc.stage.exceptions import StageNotFound

    try:
        dstage = repo.stage.load_one(name=stage.name)
    except StageNotFound:
        return None
    from dvc.dependency.param import ParamsDependency

    have_deps = {os.path.normpath(d.fs_path) for d in dstage.deps if not isinstance(d, ParamsDependency)}
    have_outs = {os.path.normpath(o.fs_path) for o in dstage.outs}
    want_deps = {_abs(cfg, stage.resolve(cfg, t)) for t in stage.deps}
    want_outs = {_abs(cfg, stage.resolve(cfg, t)) for t in stage_outputs(stage)}
    if have_deps != want_deps or have_outs != want_outs:
        return None
    _params_from_config(dstage, stage, cfg)
    return dstage


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
    if is_dvc_project():
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
    if is_dvc_project():
        with dvc_repo() as repo:
            dstage = dvc_stage(repo, stage, cfg)
            if dstage is not None:
                from dvc.stage.serialize import to_lockfile

                with repo_lock(repo):
                    # as Stage.run after the command, then dvc.repo.reproduce._reproduce_stage
                    no_cache_outs = any(not o.use_cache for o in dstage.outs if not (o.is_metric or o.is_plot))
                    dstage.save(run_cache=not no_cache_outs)
                    dstage.commit()
                    dstage.dump(update_pipeline=False)
                    cache_paths(repo, [cfg.path(p) for p in user_data(stage, cfg)])
                return to_lockfile(dstage)[stage.name]
    entry = record_flow_lock(stage, cfg).to_lock_entry(stage)
    if is_dvc_project():  # DVC does not stand for the run, yet its outputs and data go into DVC's cache
        cached = [o["path"] for o in entry["outs"] if o["md5"] and not _uncached(stage, cfg, o["path"])]
        with dvc_repo() as repo, repo_lock(repo):
            cache_paths(repo, [cfg.path(p) for p in [*cached, *user_data(stage, cfg)]])
    return entry


def _uncached(stage: Stage, cfg: Config, path: str) -> bool:
    return path in {stage.resolve(cfg, t) for t in uncached_outputs(stage)}


def _tracked_by_git(path: Path) -> bool:
    """In the repository and in git. Without git (an exported tree) every file in the repository counts as the
    project's own: only files outside it are user data then."""
    import subprocess

    try:
        rel = path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return False
    try:
        return bool(_git("ls-files", "--", rel))
    except (OSError, subprocess.CalledProcessError):
        return True


def _made_by_stages(cfg: Config) -> set[str]:
    return {os.path.normpath(s.resolve(cfg, t)) for s in STAGES for t in stage_outputs(s)}


def _is_user_data(cfg: Config, rel: str, made: set[str]) -> bool:
    """The one rule for user data: a dep neither made by a stage (`made`) nor tracked by git."""
    return os.path.normpath(rel) not in made and not _tracked_by_git(cfg.path(rel))


def user_data(stage: Stage, cfg: Config) -> list[str]:
    """The stage's deps that only the user holds: files outside the repository, or in it but neither tracked by
    git nor made by a stage (a preference file passed as `data.preferences=/abs/path`). The flow copies them
    into the DVC cache, so a run stays restorable after the file changes."""
    made = _made_by_stages(cfg)
    deps = [stage.resolve(cfg, template) for template in stage.deps]
    return [rel for rel in deps if cfg.path(rel).exists() and _is_user_data(cfg, rel, made)]


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
    if not is_dvc_project():
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


def log_run_lineage(cfg: Config, names: list[str]) -> dict[str, Any]:
    """On the active (parent) MLflow run: artifact `dvc.lock` (the lock entries of the run's stages),
    `params.yaml` (the fully resolved params) and `outputs/<path>` (the uncached outputs). A run with overrides
    that DVC recorded is also saved as a DVC experiment (tag `dvc.experiment`). Returns the lock."""
    import mlflow

    run = mlflow.active_run()
    if names and has_overrides(cfg) and all(dvc_records(get_stage(n), cfg) for n in names):
        import subprocess

        try:
            with dvc_repo() as repo, repo_lock(repo):  # dvc.lock as the last stage left it
                ref = save_experiment(
                    cfg, f"flow-{run.info.run_id[:10]}", f"pipeline run {run.info.run_id}: {', '.join(names)}"
                )
        except (OSError, subprocess.SubprocessError) as err:  # a nicety: the run is recorded and restorable anyway
            stderr = getattr(err, "stderr", b"") or b""
            print(f"could not save the run as a DVC experiment: {err} {stderr.decode(errors='replace')[-500:]}")
            ref = None
        if ref:
            mlflow.set_tag(EXP_TAG, ref.rsplit("/", 1)[-1])

    lock: dict[str, Any] = {"schema": "2.0", "stages": {}}
    for name in names:
        stage = get_stage(name)
        entry = lock_entry(stage, cfg)
        if entry:
            lock["stages"][name] = entry
        for template in uncached_outputs(stage):
            rel = stage.resolve(cfg, template)
            if cfg.path(rel).is_file():
                mlflow.log_artifact(str(cfg.path(rel)), artifact_path=_artifact_dir(rel))
    tracking.link_stage_runs(run.info.run_id)  # the stages' datasets and models, listed on the parent run
    mlflow.log_text(redact(yaml.safe_dump(lock, sort_keys=False)), LOCK_FILE)
    mlflow.log_text(redact(yaml.safe_dump(cfg.to_params(), sort_keys=False)), PARAMS_FILE)
    return lock


def _artifact_dir(path: str) -> str:
    parent = Path(os.path.normpath(path)).parent.as_posix().lstrip("/")
    return "outputs" if parent in ("", ".") else f"outputs/{parent}"


# ---- restore a run ----------------------------------------------------------------------------------------------


class RestoreError(RuntimeError):
    """A run's outputs could not be put back as recorded."""


@dataclass(frozen=True)
class Restored:
    stage: str
    path: str
    md5: str  # recorded
    actual: str | None  # after the restore
    source: str  # "dvc cache" or "mlflow"

    @property
    def ok(self) -> bool:
        return self.md5 == self.actual


def run_lock(run_id: str, cfg: Config, dst: Path) -> tuple[dict[str, Any], Path | None]:
    """The run's `dvc.lock` artifact (parsed) and its downloaded `outputs/` folder (None when it has none)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    uri = tracking.tracking_uri(cfg)
    try:
        local = mlflow.artifacts.download_artifacts(
            run_id=run_id, artifact_path=LOCK_FILE, dst_path=str(dst), tracking_uri=uri
        )
    except (MlflowException, OSError) as err:
        raise RestoreError(
            f"run {run_id} has no {LOCK_FILE} artifact ({err}): it is not a pipeline parent run "
            "logged by this version of the flow"
        ) from None
    lock = load_lock(Path(local).read_text())
    try:
        outputs = Path(
            mlflow.artifacts.download_artifacts(
                run_id=run_id, artifact_path="outputs", dst_path=str(dst), tracking_uri=uri
            )
        )
    except (MlflowException, OSError):
        outputs = None
    return lock, outputs


def restore(run_id: str, cfg: Config, remote: str | None = None) -> list[Restored]:
    """Put a parent run's outputs and user data back into the workspace: each stage's dvc.lock entry becomes the
    run's, objects missing from the local DVC cache are pulled from `remote` (default: DVC's default remote),
    DVC checks the cached outputs out, the uncached ones come from the run's artifacts, and user data files
    (`user_data`) are put back where the run read them, a changed file kept beside as `<name>.before-restore`.
    Then every output's and data file's md5 is compared with the run's record."""
    with tempfile.TemporaryDirectory() as tmp:
        lock, outputs = run_lock(run_id, cfg, Path(tmp))
        stages = lock.get("stages", {})
        if not stages:
            raise RestoreError(f"run {run_id}: its {LOCK_FILE} records no stage")
        if not is_dvc_project():
            raise RestoreError(f"{REPO_ROOT} is not a DVC project: nothing to restore from")
        data = _recorded_user_data(stages, cfg)
        sources: dict[str, str] = {}
        with dvc_repo() as repo, repo_lock(repo):
            for name, entry in stages.items():
                _write_lock_entry(repo, name, entry)
            repo._reset()  # DVC's index, if built, predates these entries
            outs = [o for n in stages for o in repo.stage.load_one(name=n).outs if o.use_cache and o.hash_info]
            cached = {o.def_path: o.hash_info.value for o in outs}
            fetch(repo, {**cached, **{p: h for _, p, h in data}}, remote)
            for name in stages:
                sources.update(_checkout_stage(repo, name, outputs))
            for _, path, md5 in data:
                sources[path] = _put_back(repo, cfg, cfg.path(path), md5)
    with dvc_md5s(state_dir(cfg)) as md5_of:
        results = [
            Restored(name, o["path"], o.get("md5"), md5_of(cfg.path(o["path"])), sources.get(o["path"], ""))
            for name, entry in stages.items()
            for o in entry.get("outs", [])
        ]
        results += [Restored(name, p, h, md5_of(cfg.path(p)), sources[p]) for name, p, h in data]
    return results


def _recorded_user_data(stages: dict[str, Any], cfg: Config) -> list[tuple[str, str, str]]:
    """(stage, path, md5) of the user data a run's lock records: deps neither tracked by git nor made by a
    stage (`user_data`'s rule, applied to the recorded paths)."""
    made = _made_by_stages(cfg) | {os.path.normpath(o["path"]) for e in stages.values() for o in e.get("outs", [])}
    return [
        (name, d["path"], d["md5"])
        for name, entry in stages.items()
        for d in entry.get("deps", [])
        if d.get("md5") and _is_user_data(cfg, d["path"], made)
    ]


def _entries(odb: Any, dirs: list[Any]) -> list[Any]:
    """The file objects listed by directory objects (`.dir`) that are in `odb`: DVC's remotes move objects one
    by one, so a directory goes with its files."""
    from dvc_data.hashfile.tree import Tree

    return [oid for h in dirs if odb.exists(h.value) for _, _, oid in Tree.load(odb, h)]


def fetch(repo: Any, objects: dict[str, str], remote: str | None = None) -> None:
    """Make sure every object (path -> DVC md5; a directory: its files too) is in the local DVC cache: pull the
    missing ones from `remote` (default: DVC's default remote). Raises RestoreError naming what is nowhere."""
    from dvc_data.hashfile.hash_info import HashInfo

    odb = repo.cache.local
    wanted = {p: HashInfo("md5", h) for p, h in objects.items()}

    def missing() -> dict[str, list[Any]]:
        found: dict[str, list[Any]] = {}
        for path, h in wanted.items():
            lacking = [o for o in [h, *_entries(odb, [h] if h.isdir else [])] if not odb.exists(o.value)]
            if lacking:
                found[path] = lacking
        return found

    lacking = missing()
    if not lacking:
        return
    if not (remote or repo.config["core"].get("remote")):
        raise RestoreError(
            f"not in the local DVC cache and no DVC remote to pull from: {sorted(lacking)} "
            "(configure one: `dvc remote add -d NAME URL`, or pass --remote)"
        )
    for _ in range(2):  # a directory's `.dir` first, then the files it lists
        repo.cloud.pull({o for objs in lacking.values() for o in objs}, remote=remote)
        lacking = missing()
    if lacking:
        raise RestoreError(f"not in the local DVC cache, and the DVC remote lacks them too: {sorted(lacking)}")


def _put_back(repo: Any, cfg: Config, path: Path, md5: str) -> str:
    """Check a cached file or directory out at `path`; a different file there is kept as `<name>.before-restore`."""
    from dvc_data.hashfile import load
    from dvc_data.hashfile.checkout import checkout
    from dvc_data.hashfile.hash_info import HashInfo

    with dvc_md5s(state_dir(cfg)) as md5_of:
        if md5_of(path) == md5:
            return "unchanged"
    if path.exists():
        path.rename(path.with_name(path.name + ".before-restore"))
    odb = repo.cache.local
    checkout(str(path), repo.fs, load(odb, HashInfo("md5", md5)), odb, force=True)
    return "dvc cache"


# ---- pushing a run to a DVC remote -------------------------------------------------------------------------------


def check_remote(remote: str | None = None) -> str:
    """The name of the DVC remote a push would go to; a clear error, before any training, when there is none."""
    if not is_dvc_project():
        raise RuntimeError(f"--push needs a DVC project: {REPO_ROOT} has no .dvc/ and dvc.yaml")
    with dvc_repo() as repo:
        name = remote or repo.config["core"].get("remote")
        if not name:
            raise RuntimeError("--push needs a DVC remote: `dvc remote add -d NAME URL`, or --remote NAME")
        if name not in repo.config["remote"]:
            raise RuntimeError(f"no DVC remote named {name!r} (`dvc remote list` shows the configured ones)")
    return name


def push_run(lock: dict[str, Any], cfg: Config, remote: str | None = None) -> int:
    """Push what a run's lock records (cached outputs and user data) from the local DVC cache to `remote`
    (default: DVC's default remote), so `restore` on another machine can pull it. Returns the number of
    objects sent; raises RuntimeError when no remote is configured or an object could not be sent."""
    from dvc_data.hashfile.hash_info import HashInfo

    stages = lock.get("stages", {})
    check_remote(remote)
    with dvc_repo() as repo, repo_lock(repo):
        odb = repo.cache.local
        objects = {o["md5"] for e in stages.values() for o in e.get("outs", []) if o.get("md5")}
        objects |= {h for _, _, h in _recorded_user_data(stages, cfg)}
        present = [HashInfo("md5", h) for h in sorted(objects) if odb.exists(h)]  # metrics live in git and MLflow
        result = repo.cloud.push({*present, *_entries(odb, [h for h in present if h.isdir])}, remote=remote)
    if result.failed:
        raise RuntimeError(f"could not push {len(result.failed)} object(s) to the DVC remote")
    return len(result.transferred)


def _write_lock_entry(repo: Any, name: str, entry: dict[str, Any]) -> None:
    """The stage's dvc.lock entry becomes the run's (deps, params and outputs as they were)."""
    from dvc.stage.exceptions import StageNotFound
    from dvc.stage.loader import StageLoader

    try:
        dstage = repo.stage.load_one(name=name)
    except StageNotFound:
        raise RestoreError(f"stage {name} of the run is not in dvc.yaml") from None
    by_path = {o.def_path: o for o in dstage.outs}
    unknown = [o["path"] for o in entry.get("outs", []) if o["path"] not in by_path]
    if unknown:
        raise RestoreError(
            f"stage {name}: the run wrote {unknown}, which dvc.yaml does not list as outputs "
            "(an override moved them): restore with the same paths in params.yaml"
        )
    StageLoader.fill_from_lock(dstage, entry)
    dstage.dump(update_pipeline=False)


def _checkout_stage(repo: Any, name: str, outputs: Path | None) -> dict[str, str]:
    """DVC checks out the stage's cached outputs as its dvc.lock entry has them; the uncached ones are copied
    from the run's artifacts."""
    dstage = repo.stage.load_one(name=name)
    sources = {}
    cached = [o for o in dstage.outs if o.use_cache]
    if cached:
        repo.checkout(targets=[name], force=True)  # `fetch` brought what was missing
        sources.update({o.def_path: "dvc cache" for o in cached})
    for out in dstage.outs:
        if out.use_cache:
            continue
        copy = outputs / os.path.normpath(out.def_path).lstrip("/") if outputs else None
        if copy is None or not copy.is_file():
            raise RestoreError(f"stage {name}: the run kept no copy of {out.def_path}")
        Path(out.fs_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(copy, out.fs_path)
        sources[out.def_path] = "mlflow"
    return sources


# ---- runs with overrides as DVC experiments (`dvc exp show`) -----------------------------------------------------

EXP_TAG = "dvc.experiment"


def has_overrides(cfg: Config) -> bool:
    """The run's config differs from the repository's params.yaml (--set, the Prefect form, --params)."""

    return cfg.to_params() != load_config().to_params()


def _git(*args: str, env: dict[str, str] | None = None, stdin: bytes | None = None) -> str:
    import subprocess

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


def save_experiment(cfg: Config, name: str, message: str) -> str | None:
    """Record the run as a DVC experiment on the current commit, as `dvc exp save` would, without touching the
    workspace: a commit (parent HEAD) of the tracked files as they are in the workspace, with params.yaml holding
    the run's resolved params and the run's dvc.lock, metrics and plot data, under `refs/exps/...`. Returns the
    ref, or None where there is no git commit to hang it on."""
    import subprocess

    from dvc.repo.experiments.refs import ExpRefInfo

    try:
        head = _git("rev-parse", "--verify", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        return None
    ident = {
        "GIT_AUTHOR_NAME": "rlhflow flow",
        "GIT_AUTHOR_EMAIL": "flow@rlhflow",
        "GIT_COMMITTER_NAME": "rlhflow flow",
        "GIT_COMMITTER_EMAIL": "flow@rlhflow",
    }
    files: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        write_params(cfg, Path(tmp) / PARAMS_FILE)
        files[PARAMS_FILE] = redact((Path(tmp) / PARAMS_FILE).read_text()).encode()
    if (REPO_ROOT / LOCK_FILE).is_file():
        files[LOCK_FILE] = (REPO_ROOT / LOCK_FILE).read_bytes()
    for stage in STAGES:
        for template in uncached_outputs(stage):
            path = cfg.path(stage.resolve(cfg, template))
            try:
                rel = path.resolve().relative_to(REPO_ROOT).as_posix()
            except ValueError:
                continue  # outside the repository: not part of a commit
            if path.is_file():
                files[rel] = path.read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**ident, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        _git("read-tree", "HEAD", env=env)
        _git("add", "--update", env=env)  # tracked files as they are in the workspace (the code that ran)
        for rel, data in files.items():
            blob = _git("hash-object", "-w", "--stdin", stdin=data)
            _git("update-index", "--add", "--cacheinfo", f"100644,{blob},{rel}", env=env)
        tree = _git("write-tree", env=env)
        commit = _git("commit-tree", tree, "-p", head, "-m", message, env=env)
    ref = str(ExpRefInfo(baseline_sha=head, name=name))
    _git("update-ref", ref, commit)
    return ref
