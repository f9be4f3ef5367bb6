"""Put a pipeline run's outputs back: each stage's dvc.lock entry becomes the run's (the `dvc.lock` artifact of
its MLflow parent run, rlhfops/run_record.py), DVC checks the cached outputs out (pulling missing objects from a
remote), the uncached ones come from the run's artifacts, and every md5 is checked against the record; and push a
run's objects to a DVC remote.

A record is data from a tracking server and a remote that others can write to, so a restore trusts none of it
before checking: it writes only where the current stage list and config put a stage's outputs and user data,
inside the workspace (`check_record`), each object's md5 is checked in the cache before it is checked out
(`verify_objects`), and the workspace is held throughout (rlhfops/workspace.py). Any refusal comes before the
first write.
"""

from __future__ import annotations

# dvc and boto3 are heavy: they are imported inside the functions that use them (boto3 only for an S3 store).
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException

from rlhflow.config.params import REPO_ROOT, Config
from rlhflow.fsutil import atomic_file
from rlhfops import tracking, workspace
from rlhfops.dvc_yaml import stage_deps
from rlhfops.hashing import dvc_md5s, file_md5
from rlhfops.stage_lock import (
    LOCK_FILE,
    declared_target,
    dvc_repo,
    is_dvc_project,
    is_user_data,
    load_declared,
    load_lock,
    made_by_stages,
    repo_lock,
    stage_outputs,
    state_dir,
)
from rlhfops.stages import STAGE_NAMES, get_stage

# what DVC records for a file (md5) or a directory (md5 of its listing, `.dir`); anything else is no object name
OBJECT_NAME = re.compile(r"[0-9a-f]{32}(\.dir)?")


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

    client = tracking.client(tracking.tracking_uri(cfg))
    try:
        local = client.download_artifacts(run_id, LOCK_FILE, str(dst))
    except (MlflowException, OSError) as err:
        raise RestoreError(
            f"run {run_id} has no {LOCK_FILE} artifact ({err}): it is not a pipeline parent run "
            "logged by this version of the flow"
        ) from None
    lock = load_lock(Path(local).read_text())
    try:
        outputs = Path(client.download_artifacts(run_id, "outputs", str(dst)))
    except (MlflowException, OSError):
        outputs = None
    return lock, outputs


def restore(run_id: str, cfg: Config, remote: str | None = None) -> list[Restored]:
    """Put a parent run's outputs and user data back into the workspace (`restore_lock` of its `dvc.lock`
    artifact, the uncached outputs from its `outputs/` artifacts), holding the workspace throughout. The tracking
    store passes the preflight first (tracking.preflight)."""
    tracking.preflight(cfg)
    with workspace.exclusive(f"restore of run {run_id}"), tempfile.TemporaryDirectory() as tmp:
        lock, outputs = run_lock(run_id, cfg, Path(tmp))
        stages = lock.get("stages", {})
        if not stages:
            raise RestoreError(f"run {run_id}: its {LOCK_FILE} records no stage")
        return restore_lock(stages, cfg, remote, outputs)


def restore_lock(
    stages: dict[str, Any], cfg: Config, remote: str | None = None, outputs: Path | None = None
) -> list[Restored]:
    """Put the outputs and user data that lock entries (stage -> entry) record back into the workspace: each
    stage's dvc.lock entry becomes the recorded one, objects missing from the local DVC cache are pulled from
    `remote` (default: DVC's default remote), DVC checks the cached outputs out, the uncached ones are copied from
    `outputs` (a run's `outputs/` artifacts), and user data files
    (`user_data`) are put back where the run read them, a changed file kept beside as `<name>.before-restore`.
    Nothing is written before every path is found to be one the stage list and config name (`check_record`) and
    every object and copy to hold its recorded md5 (`verify_objects`); the workspace is held all along. Then
    every restored file's md5 is compared with the record."""
    if not is_dvc_project():
        raise RestoreError(f"{REPO_ROOT} is not a DVC project: nothing to restore from")
    with workspace.exclusive("a restore"):
        data = check_record(stages, cfg)
        sources: dict[str, str] = {}
        with dvc_repo() as repo, repo_lock(repo):
            declared = {name: _declared_stage(repo, name, entry) for name, entry in stages.items()}
            cached, copies = _recorded_outputs(stages, declared)
            objects = {**cached, **{p: h for _, p, h in data}}
            fetch(repo, objects, remote)
            verify_objects(repo, cfg, objects)
            _verify_copies(copies, outputs)
            # every check passed: from here on the workspace is written
            for name, entry in stages.items():
                _write_lock_entry(declared[name], entry)
            repo._reset()  # DVC's index, if built, predates these entries
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
    made = made_by_stages(cfg) | {os.path.normpath(o["path"]) for e in stages.values() for o in e.get("outs", [])}
    return [
        (name, d["path"], d["md5"])
        for name, entry in stages.items()
        for d in entry.get("deps", [])
        if d.get("md5") and is_user_data(cfg, d["path"], made)
    ]


# ---- what a record may write, checked before anything is written -------------------------------------------------


def _inside(path: Path, root: Path = REPO_ROOT) -> bool:
    """Whether `path`, every symlink on the way followed, lies under `root`."""
    return path.resolve().is_relative_to(root.resolve())


def _refusal(cfg: Config, stage: str, kind: str, path: str, md5: Any, named: set[str]) -> str | None:
    """Why the record's `path` (an output, or user data it would put back) may not be written; None when it may:
    the current stage list and config name it for that stage, it holds a DVC object name, and it lies inside the
    workspace. User data outside it is put back only where the config itself names that path (a user's own file,
    `--set data.preferences=/abs/path`), never because a record says so."""
    rel = os.path.normpath(path)
    if rel not in named:
        return f"stage {stage}: {kind} {path} is not a path the stage list and the config name for this stage"
    if md5 is not None and not (isinstance(md5, str) and OBJECT_NAME.fullmatch(md5)):
        return f"stage {stage}: {kind} {path} has md5 {md5!r}, which names no DVC object"
    where = Path(os.path.normpath(cfg.path(rel)))
    if kind == "user data" and not where.is_relative_to(REPO_ROOT):
        return None  # the user's own file, where the config (not the record) says it is
    if not _inside(where):
        return f"stage {stage}: {kind} {path} leads outside the workspace {REPO_ROOT} (to {where.resolve()})"
    return None


def check_record(stages: dict[str, Any], cfg: Config) -> list[tuple[str, str, str]]:
    """Refuse a record (stage -> lock entry) that would write anywhere but where the current stage list and
    `cfg` put a stage's outputs and user data: every such path named at once, before anything is written.
    Returns the user data to put back: (stage, path, md5)."""
    problems = [
        f"stage {n!r} is not in the stage list ({', '.join(STAGE_NAMES)})" for n in stages if n not in STAGE_NAMES
    ]
    known = {n: e for n, e in stages.items() if n in STAGE_NAMES}
    data = _recorded_user_data(known, cfg)
    for name, entry in known.items():
        stage = get_stage(name)
        outs = {os.path.normpath(stage.resolve(cfg, t)) for t in stage_outputs(stage)}
        problems += [
            _refusal(cfg, name, "output", o.get("path", ""), o.get("md5"), outs) for o in entry.get("outs", [])
        ]
        deps = {os.path.normpath(stage.resolve(cfg, t)) for t in stage_deps(stage)}
        problems += [_refusal(cfg, name, "user data", p, h, deps) for n, p, h in data if n == name]
    problems = [p for p in problems if p]
    if problems:
        raise RestoreError(
            "the run's record names paths a restore may not write; nothing was written: "
            + "; ".join(problems)
            + " (a run made with `--set` overrides that move paths restores with the same ones)"
        )
    return data


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


# ---- the objects a record names, checked in the cache before anything is checked out -----------------------------


def _object_problem(odb: Any, md5: str) -> str | None:
    """Why the cache's object `md5` cannot be checked out (missing, or its bytes hash otherwise); None if sound."""
    obj = Path(odb.oid_to_path(md5))
    if not obj.is_file():
        return f"object {md5} is not in the DVC cache"
    actual = file_md5(obj)
    if actual != md5.removesuffix(".dir"):
        return f"object {md5} in the DVC cache ({obj}) has md5 {actual}: forged or corrupted"
    return None


def _listing_problems(odb: Any, target: Path, md5: str) -> list[str]:
    """What is wrong with a (sound) directory object: its listing must be DVC's, name only files inside the
    directory `target` (no absolute path, no `..`, no symlink there leading out), each a sound object."""
    try:
        entries = [(str(e["relpath"]), str(e["md5"])) for e in json.loads(Path(odb.oid_to_path(md5)).read_bytes())]
    except (ValueError, KeyError, TypeError):
        return [f"directory object {md5} is not a DVC listing"]
    problems = []
    for rel, h in entries:
        if os.path.isabs(rel) or ".." in Path(rel).parts or not _inside(target / rel, target):
            problems.append(f"its listing {md5} names {rel}, outside the directory")
        elif not OBJECT_NAME.fullmatch(h) or h.endswith(".dir"):
            problems.append(f"its listing {md5} gives {rel} the md5 {h!r}, which names no DVC object")
        elif problem := _object_problem(odb, h):
            problems.append(f"{rel}: {problem}")
    return problems


def verify_objects(repo: Any, cfg: Config, objects: dict[str, str]) -> None:
    """Every object (path -> DVC md5) is in the local DVC cache and holds what its md5 says: a file's bytes, a
    directory's listing and each file it lists, as DVC computes them. Checked before anything is checked out, so
    a forged or corrupted object writes nothing. Raises RestoreError naming each path."""
    odb = repo.cache.local
    problems = []
    for path, md5 in objects.items():
        problem = _object_problem(odb, md5)
        if problem is None and md5.endswith(".dir"):
            problems += [f"{path}: {p}" for p in _listing_problems(odb, cfg.path(path), md5)]
        elif problem:
            problems.append(f"{path}: {problem}")
    if problems:
        raise RestoreError(
            "the DVC cache does not hold what the run recorded; nothing was written: " + "; ".join(problems)
        )


def _kept_copy(outputs: Path | None, path: str) -> Path | None:
    """Where a run's artifacts keep the uncached output `path` (run_record.artifact_dir); None when they do not."""
    copy = outputs / os.path.normpath(path).lstrip("/") if outputs else None
    return copy if copy is not None and copy.is_file() else None


def _verify_copies(copies: dict[str, tuple[str, str | None]], outputs: Path | None) -> None:
    """Each uncached output (path -> (stage, recorded md5)) has a copy among the run's artifacts with that md5."""
    problems = []
    for path, (stage, md5) in copies.items():
        copy = _kept_copy(outputs, path)
        if copy is None:
            problems.append(f"stage {stage}: the run kept no copy of {path}")
        elif md5 is not None and file_md5(copy) != md5:
            problems.append(f"stage {stage}: the run's copy of {path} has md5 {file_md5(copy)}, its record {md5}")
    if problems:
        raise RestoreError("the run's artifacts differ from its record; nothing was written: " + "; ".join(problems))


def _declared_stage(repo: Any, name: str, entry: dict[str, Any]) -> Any:
    """DVC's stage `name` (dvc.yaml), every output the record gives it one that dvc.yaml lists."""
    from dvc.stage.exceptions import StageNotFound

    try:
        dstage = load_declared(repo, name)
    except StageNotFound:
        raise RestoreError(f"stage {name} of the run is not in dvc.yaml") from None
    listed = {o.def_path for o in dstage.outs}
    unknown = [o["path"] for o in entry.get("outs", []) if o["path"] not in listed]
    if unknown:
        raise RestoreError(
            f"stage {name}: the run wrote {unknown}, which dvc.yaml does not list as outputs "
            "(an override moved them): restore with the same paths in params.yaml"
        )
    return dstage


def _recorded_outputs(
    stages: dict[str, Any], declared: dict[str, Any]
) -> tuple[dict[str, str], dict[str, tuple[str, str | None]]]:
    """The record's outputs that DVC caches (path -> md5) and those the run's artifacts keep (path -> (stage,
    md5)): every uncached output dvc.yaml lists for a recorded stage, as `_checkout_stage` copies them."""
    cached, copies = {}, {}
    for name, entry in stages.items():
        recorded = {o["path"]: o.get("md5") for o in entry.get("outs", [])}
        for out in declared[name].outs:
            if out.use_cache and recorded.get(out.def_path):
                cached[out.def_path] = recorded[out.def_path]
            elif not out.use_cache:
                copies[out.def_path] = (name, recorded.get(out.def_path))
    return cached, copies


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
        reach_remote(name, dict(repo.config["remote"][name]))
    return name


class RemoteUnavailableError(RuntimeError):
    """The DVC remote cannot be reached or refuses the credentials: nothing was run."""


def reach_remote(name: str, conf: dict[str, Any], timeout: float = 5.0) -> None:
    """One request to the DVC remote `name` (its `dvc remote` config `conf`) within `timeout` seconds: an S3
    remote's bucket must answer with the credentials given (its config, else the AWS environment), a local one
    must be a directory or creatable. Raises RemoteUnavailableError naming the remote and why; other kinds of
    remote are not checked."""
    url = str(conf.get("url", ""))
    if url.startswith("s3://"):
        _reach_s3(name, url, conf, timeout)
    elif "://" not in url:
        path = Path(url)
        while not path.exists() and path != path.parent:
            path = path.parent
        if not (path.is_dir() and os.access(path, os.W_OK)):
            raise RemoteUnavailableError(f"DVC remote {name!r} ({url}): {path} is not a writable directory")


def _reach_s3(name: str, url: str, conf: dict[str, Any], timeout: float) -> None:
    import boto3
    from botocore.config import Config as BotoConfig
    from botocore.exceptions import BotoCoreError, ClientError

    bucket = url.removeprefix("s3://").split("/", 1)[0]
    endpoint = conf.get("endpointurl")
    where = f"DVC remote {name!r} ({url}{' at ' + endpoint if endpoint else ''})"
    # a session of its own: boto3's default session keeps the first credentials it read from the environment
    client = boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=conf.get("access_key_id"),
        aws_secret_access_key=conf.get("secret_access_key"),
        region_name=conf.get("region") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        # one try, short timeouts: an unreachable store fails here in seconds, not after botocore's retries
        config=BotoConfig(connect_timeout=timeout, read_timeout=timeout, retries={"total_max_attempts": 1}),
    )
    try:
        client.list_objects_v2(Bucket=bucket, MaxKeys=1)
    except ClientError as err:
        code = err.response.get("Error", {}).get("Code", "")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "Forbidden"):
            why = f"the store refuses the credentials ({code}): check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        elif code == "NoSuchBucket":
            why = f"bucket {bucket!r} does not exist"
        else:
            why = f"{code}: {err}"
        raise RemoteUnavailableError(f"{where}: {why}. Nothing was run.") from None
    except BotoCoreError as err:  # no credentials, connection refused, timeout
        raise RemoteUnavailableError(f"{where} is unreachable or unusable ({err}). Nothing was run.") from None


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


def _write_lock_entry(dstage: Any, entry: dict[str, Any]) -> None:
    """The stage's dvc.lock entry becomes the run's (deps, params and outputs as they were)."""
    from dvc.stage.loader import StageLoader

    StageLoader.fill_from_lock(dstage, entry)
    dstage.dump(update_pipeline=False)


def _checkout_stage(repo: Any, name: str, outputs: Path | None) -> dict[str, str]:
    """DVC checks out the stage's cached outputs as its dvc.lock entry has them (`fetch` brought what was
    missing, `verify_objects` checked it); the uncached ones are copied from the run's artifacts."""
    dstage = load_declared(repo, name)
    sources = {}
    cached = [o for o in dstage.outs if o.use_cache]
    if cached:
        repo.checkout(targets=[declared_target(repo, name)], force=True)
        sources.update({o.def_path: "dvc cache" for o in cached})
    for out in dstage.outs:
        if out.use_cache:
            continue
        copy = _kept_copy(outputs, out.def_path)  # `_verify_copies` found it, with the recorded md5
        # through the writes rule: a file the pipeline did not put there is refused, not replaced
        with open(copy, "rb") as source, atomic_file(out.fs_path, binary=True) as target:
            shutil.copyfileobj(source, target)
        sources[out.def_path] = "mlflow"
    return sources
