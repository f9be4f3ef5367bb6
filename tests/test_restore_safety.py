"""A restore writes only where the current stage list and config put a stage's outputs and user data, inside the
workspace, checks every object before checking it out, and holds the workspace (rlhfops/restore.py): a forged
record fails naming the path, with nothing written.

Real DVC in a real git repo, a real MLflow sqlite store, the demo_data stage run by the flow."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import make_dvc_repo
from test_lineage import _parent_runs, succeeding
from test_workspace import hold_in_another_process

from rlhfops import stage_lock
from rlhfops.hashing import file_md5

pytestmark = pytest.mark.system

PREFERENCES = "data/raw/demo/preferences.jsonl"
CANARY = "the user's own file: a restore must not touch it\n"

# `rlhfops.restore.restore` of one run in the repository it runs in; a refusal printed, exit status 1
RESTORE = textwrap.dedent("""
    import sys
    from rlhflow.config.params import load_config
    from rlhfops import restore
    try:
        restore.restore(sys.argv[1], load_config())
    except restore.RestoreError as err:
        print(f"restore failed: {err}")
        sys.exit(1)
    print("restored")
""")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, tiny_model_dir):
    """A DVC project in a git repo whose MLflow store holds one parent run of the flow (the demo_data stage)."""
    repo = tmp_path_factory.mktemp("restore") / "repo"
    run = make_dvc_repo(repo, tiny_model_dir, timeout=600)
    succeeding(run)(sys.executable, "-m", "flows.pipeline", "--stages", "demo_data")
    parent = _parent_runs(repo / "mlflow.db")[-1]
    return repo, run, parent.info.run_id


def _store(repo: Path):
    import mlflow

    return mlflow.MlflowClient(f"sqlite:///{repo}/mlflow.db")


def _logged_lock(repo: Path, run_id: str, dst: Path) -> dict:
    return stage_lock.load_lock(Path(_store(repo).download_artifacts(run_id, "dvc.lock", str(dst))).read_text())


def _forge(repo: Path, real_run: str, lock: dict, dst: Path) -> str:
    """A parent run in the same store whose `dvc.lock` is `lock`, its `outputs/` those of `real_run`."""
    client = _store(repo)
    real = client.get_run(real_run)
    forged = client.create_run(real.info.experiment_id, tags={"pipeline": "rlhf"}).info.run_id
    client.log_text(forged, yaml.safe_dump(lock, sort_keys=False), "dvc.lock")
    client.log_artifacts(forged, client.download_artifacts(real_run, "outputs", str(dst)), "outputs")
    return forged


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file of the workspace but git's, DVC's and the tracking store's: (size, mtime), to see any write."""
    skip = {".git", ".dvc", "mlflow.db", "mlruns", "mlartifacts"}
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file() and p.relative_to(root).parts[0] not in skip
    }


def _md5_of(entry: dict, path: str) -> str:
    return next(o["md5"] for o in entry["outs"] if os.path.normpath(o["path"]) == path)


def _with_dep(entry: dict, path: str, md5: str) -> dict:
    return {**entry, "deps": [*entry["deps"], {"path": path, "hash": "md5", "md5": md5}]}


@pytest.mark.parametrize("where", ["absolute", "parent", "undeclared"])
def test_a_record_naming_a_path_no_stage_writes_fails_naming_it_and_writes_nothing(recorded, tmp_path, where):
    """A user-data dep the record adds (it would be put back from the cache): outside the workspace by an
    absolute path or by `../`, or inside it where no stage reads. Each holds a canary the restore must leave."""
    repo, run, real_run = recorded
    lock = _logged_lock(repo, real_run, tmp_path / "real")
    entry = lock["stages"]["demo_data"]
    prefs_md5 = _md5_of(entry, PREFERENCES)  # an object in the cache
    target = {
        "absolute": tmp_path / "outside" / "canary.txt",
        "parent": repo.parent / f"canary-{tmp_path.name}.txt",
        "undeclared": repo / "scratch" / "canary.txt",
    }[where]
    named = {"absolute": str(target), "parent": f"../{target.name}", "undeclared": "scratch/canary.txt"}[where]
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(CANARY)
    forged = _forge(repo, real_run, {**lock, "stages": {"demo_data": _with_dep(entry, named, prefs_md5)}}, tmp_path)

    before, canary_before = _files(repo), target.stat()
    res = run(sys.executable, "-c", RESTORE, forged)
    out = res.stdout + res.stderr
    assert res.returncode == 1 and "restore failed" in out and named in out, out[-3000:]
    assert "is not a path the stage list and the config name" in out, out[-3000:]
    assert target.read_text() == CANARY and target.stat().st_mtime_ns == canary_before.st_mtime_ns
    assert sorted(p.name for p in target.parent.iterdir() if p.name.startswith(target.name)) == [target.name]
    assert _files(repo) == before  # dvc.lock, the stage's outputs: nothing written, nothing new
    target.unlink()


def test_a_record_whose_md5_its_object_does_not_hold_fails_naming_the_path_and_writes_nothing(recorded, tmp_path):
    """The record names, for the stage's output, an object that is in the cache but holds other bytes (planted
    there, or pulled so from a remote): checked before the checkout, it never reaches the workspace."""
    repo, run, real_run = recorded
    lock = _logged_lock(repo, real_run, tmp_path / "real")
    entry = lock["stages"]["demo_data"]
    forged_md5 = hashlib.md5(b"what the record claims\n").hexdigest()
    planted = repo / ".dvc/cache/files/md5" / forged_md5[:2] / forged_md5[2:]
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_bytes(b"what the cache holds instead\n")
    outs = [{**o, "md5": forged_md5} if os.path.normpath(o["path"]) == PREFERENCES else o for o in entry["outs"]]
    forged = _forge(repo, real_run, {**lock, "stages": {"demo_data": {**entry, "outs": outs}}}, tmp_path)
    workspace_copy = (repo / PREFERENCES).read_bytes()

    before = _files(repo)
    try:
        res = run(sys.executable, "-c", RESTORE, forged)
    finally:
        planted.unlink()
    out = res.stdout + res.stderr
    assert res.returncode == 1 and f"{PREFERENCES}: object {forged_md5}" in out and "forged or corrupted" in out, out
    assert (repo / PREFERENCES).read_bytes() == workspace_copy
    assert _files(repo) == before


def test_an_output_reached_through_a_symlink_leading_out_is_refused(recorded, tmp_path):
    """The run's own, genuine record, but the output's directory in the workspace is a symlink to a directory
    elsewhere: restoring would write there, so the restore refuses, naming the output."""
    repo, run, real_run = recorded
    demo, elsewhere = repo / PREFERENCES.rsplit("/", 1)[0], tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "preferences.jsonl").write_text(CANARY)
    kept = demo.with_name(demo.name + ".kept")
    demo.rename(kept)
    demo.symlink_to(elsewhere, target_is_directory=True)
    try:
        before = _files(repo)
        res = run(sys.executable, "-c", RESTORE, real_run)
        after = _files(repo)
    finally:
        demo.unlink()
        kept.rename(demo)
    out = res.stdout + res.stderr
    assert res.returncode == 1 and re.search(rf"output (\./)?{PREFERENCES} leads outside the workspace", out), out
    assert (elsewhere / "preferences.jsonl").read_text() == CANARY and after == before


def test_a_restore_waits_while_another_run_holds_the_workspace(recorded, tmp_path):
    """`python -m flows.restore` while a pipeline run holds the workspace: it says it waits, writes nothing
    meanwhile, and restores once the workspace is free."""
    repo, run, real_run = recorded
    (repo / PREFERENCES).unlink()  # the restore puts it back: a write to watch for
    holder = hold_in_another_process(repo, 600)
    # the CLI, with the workspace's wait notices made frequent so the test sees the restore reach the lock
    cli = "import sys; from rlhfops import workspace; workspace.NOTICE_S = 1; workspace.POLL_S = 0.2\n"
    cli += "from flows.restore import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(repo)}
    env.pop("MLFLOW_TRACKING_URI", None)
    restore = subprocess.Popen(
        [sys.executable, "-c", cli, real_run], cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.decode() for line in restore.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not any("waiting for pipeline flow run 'calm-otter'" in line for line in lines):
            assert restore.poll() is None, "".join(lines)[-3000:]  # it must not finish while the workspace is held
            assert time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.5)
        time.sleep(2)
        assert restore.poll() is None and not (repo / PREFERENCES).exists(), "".join(lines)[-3000:]
    finally:
        holder.kill()
        holder.wait()
    assert restore.wait(timeout=300) == 0, "".join(lines)[-3000:]
    reader.join(timeout=10)
    assert "the workspace is free after" in "".join(lines) and "MISMATCH" not in "".join(lines)
    entry = _logged_lock(repo, real_run, tmp_path / "real")["stages"]["demo_data"]
    assert file_md5(repo / PREFERENCES) == _md5_of(entry, PREFERENCES)
