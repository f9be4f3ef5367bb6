"""Put a pipeline run's outputs back: each stage's dvc.lock entry becomes the run's (the `dvc.lock` artifact of
its MLflow parent run, rlhfops/run_record.py), DVC checks the cached outputs out (pulling missing objects from a
remote), the uncached ones come from the run's artifacts, and every md5 is checked against the record; and push a
run's objects to a DVC remote.
"""

from __future__ import annotations

# dvc and mlflow are heavy: they are imported inside the functions that use them.
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhflow.config import REPO_ROOT, Config
from rlhfops import tracking
from rlhfops.hashing import dvc_md5s
from rlhfops.stage_lock import (
    LOCK_FILE,
    dvc_repo,
    is_dvc_project,
    is_user_data,
    load_lock,
    made_by_stages,
    repo_lock,
    state_dir,
)


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
    """Put a parent run's outputs and user data back into the workspace (`restore_lock` of its `dvc.lock`
    artifact, the uncached outputs from its `outputs/` artifacts)."""
    with tempfile.TemporaryDirectory() as tmp:
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
    Then every restored file's md5 is compared with the record."""
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
    made = made_by_stages(cfg) | {os.path.normpath(o["path"]) for e in stages.values() for o in e.get("outs", [])}
    return [
        (name, d["path"], d["md5"])
        for name, entry in stages.items()
        for d in entry.get("deps", [])
        if d.get("md5") and is_user_data(cfg, d["path"], made)
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
