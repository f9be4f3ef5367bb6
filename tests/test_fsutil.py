"""rlhflow/fsutil.py: a file written through atomic_file appears whole or not at all, in text and in bytes; a
directory the pipeline did not make is never replaced or deleted (atomic_dir, prepare_checkpoint_dir, the removal of
stale temporary paths), and is left as it was."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlhflow import fsutil
from rlhflow.fsutil import (
    MADE_MARKER,
    WRITTEN_RECORDS,
    ForeignPathError,
    atomic_dir,
    atomic_file,
    is_made,
    mark_made,
    prepare_checkpoint_dir,
    remove_made,
    remove_stale_temps,
    write_text_atomic,
)


@pytest.mark.parametrize("binary, content", [(False, "a line\n"), (True, b"\x89PNG\r\n\x1a\n")])
def test_atomic_file_writes_whole_or_leaves_nothing(tmp_path, binary, content):
    path = tmp_path / "out" / "figure.png"
    with atomic_file(path, binary=binary) as f:
        f.write(content)
    assert (path.read_bytes() if binary else path.read_text()) == content

    with pytest.raises(RuntimeError, match="drawing failed"), atomic_file(path, binary=binary) as f:
        f.write(content[:2])
        raise RuntimeError("drawing failed")
    assert (path.read_bytes() if binary else path.read_text()) == content  # the earlier file, untouched
    # no temp file left, beside the file or its record
    assert sorted(p.name for p in path.parent.iterdir()) == [WRITTEN_RECORDS, "figure.png"]
    assert sorted(p.name for p in (path.parent / WRITTEN_RECORDS).iterdir()) == ["figure.png"]


def dead_pid() -> int:
    """The id of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_atomic_dir_refuses_a_directory_it_did_not_make(tmp_path):
    out = tmp_path / "data"
    out.mkdir()
    (out / "canary.txt").write_text("mine")
    with pytest.raises(ForeignPathError, match=rf"ppo\.out_dir={re.escape(str(out))}.*no {re.escape(MADE_MARKER)}"):
        with atomic_dir(out, setting="ppo.out_dir") as tmp:
            (tmp / "model.safetensors").write_text("weights")
    assert (out / "canary.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # nothing swapped, no temp left
    assert sorted(p.name for p in out.iterdir()) == ["canary.txt"]


def test_atomic_dir_replaces_its_own_output_and_marks_it(tmp_path):
    out = tmp_path / "policy"
    out.mkdir()  # an empty directory holds nothing to lose
    for content in ("first", "second"):
        with atomic_dir(out, setting="ppo.out_dir") as tmp:
            (tmp / "model.txt").write_text(content)
        assert (out / "model.txt").read_text() == content
        assert is_made(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]
    assert json.loads((out / MADE_MARKER).read_text()) == {"made_by": "rlhflow", "setting": "ppo.out_dir"}


def test_prepare_checkpoint_dir_refuses_a_directory_it_did_not_make(tmp_path):
    ckpt = tmp_path / "data"
    ckpt.mkdir()
    (ckpt / "canary.txt").write_text("mine")
    with pytest.raises(ForeignPathError, match=rf"ppo\.checkpoint_dir={re.escape(str(ckpt))}"):
        prepare_checkpoint_dir(ckpt, "inputs-1", setting="ppo.checkpoint_dir")
    assert sorted(p.name for p in ckpt.iterdir()) == ["canary.txt"]
    assert (ckpt / "canary.txt").read_text() == "mine"


def test_prepare_checkpoint_dir_keeps_the_same_inputs_and_clears_its_own_of_other_inputs(tmp_path):
    ckpt = prepare_checkpoint_dir(tmp_path / "ckpt", "inputs-1", setting="sft.checkpoint_dir")
    (ckpt / "checkpoint-4").mkdir()
    prepare_checkpoint_dir(ckpt, "inputs-1", setting="sft.checkpoint_dir")
    assert (ckpt / "checkpoint-4").is_dir()  # same inputs: resumed from
    prepare_checkpoint_dir(ckpt, "inputs-2", setting="sft.checkpoint_dir")
    assert sorted(p.name for p in ckpt.iterdir()) == [MADE_MARKER, "inputs.json"]
    assert (ckpt / "inputs.json").read_text() == "inputs-2"
    assert remove_made(ckpt) and not ckpt.exists()


@pytest.mark.system
def test_stale_temp_cleanup_removes_only_what_the_pipeline_made(tmp_path):
    pid = dead_pid()
    final = tmp_path / "validated"
    ours = tmp_path / f".validated.tmp-{pid}-0a1b2c3d"
    ours.mkdir()
    mark_made(ours, "validate.out_dir")
    (ours / "train.jsonl").write_text("half")
    foreign_dir = tmp_path / f".validated.tmp-{pid}"
    foreign_dir.mkdir()
    (foreign_dir / "canary.txt").write_text("mine")
    foreign_file = tmp_path / f".validated.tmp-{pid}-0a1b2c3d.bak"
    foreign_file.write_text("mine too")
    foreign_old = tmp_path / f".validated.old-{pid}"  # no output at `final`: only a marked one is put back
    foreign_old.mkdir()
    (foreign_old / "canary.txt").write_text("mine three")

    assert remove_stale_temps(final) == [ours]
    assert not ours.exists() and not final.exists()
    assert (foreign_dir / "canary.txt").read_text() == "mine"
    assert foreign_file.read_text() == "mine too"
    assert (foreign_old / "canary.txt").read_text() == "mine three"


@pytest.mark.system
def test_a_killed_swap_puts_the_previous_output_back(tmp_path):
    pid = dead_pid()
    old = tmp_path / f".validated.old-{pid}-0a1b2c3d"
    old.mkdir()
    mark_made(old, "validate.out_dir")
    (old / "train.jsonl").write_text("previous")
    remove_stale_temps(tmp_path / "validated")
    assert (tmp_path / "validated" / "train.jsonl").read_text() == "previous"


def test_a_replaced_file_keeps_its_privacy_and_a_link_is_neither_followed_nor_replaced(tmp_path):
    """An output file the owner made private (0600) stays so when a stage writes it again; a symbolic link at an
    output's path (to a private file elsewhere, say) is refused: neither its target nor the link changes."""
    private = tmp_path / "metrics.json"
    write_text_atomic(private, "{}\n")
    private.chmod(0o600)
    write_text_atomic(private, '{"a": 1}\n')
    assert private.read_text() == '{"a": 1}\n' and private.stat().st_mode & 0o777 == 0o600
    target = tmp_path / "elsewhere" / "secret.txt"
    target.parent.mkdir()
    target.write_text("private\n")
    link = tmp_path / "report.md"
    link.symlink_to(target)
    with pytest.raises(ForeignPathError, match="is a symbolic link"):
        write_text_atomic(link, "report\n")
    assert link.is_symlink() and target.read_text() == "private\n"


def test_an_output_file_is_written_only_over_a_regular_file_and_through_no_linked_directory(tmp_path):
    """A directory, a FIFO (a writer would block on it) or a linked parent directory at an output file's path fails
    naming it, and what stands there is left as it was."""
    directory = tmp_path / "metrics.json"
    (directory / "inner").mkdir(parents=True)
    fifo = tmp_path / "report.md"
    os.mkfifo(fifo)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("mine\n")
    (tmp_path / "reports").symlink_to(elsewhere)
    for path, problem in (
        (directory, "is a directory, not a regular file"),
        (fifo, "is a FIFO, not a regular file"),
        (tmp_path / "reports" / "notes.txt", "its directory .*reports is a symbolic link"),
    ):
        with pytest.raises(ForeignPathError, match=rf"{re.escape(str(path))}:? {problem}"):
            write_text_atomic(path, "new\n")
    assert (directory / "inner").is_dir() and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert (elsewhere / "notes.txt").read_text() == "mine\n" and sorted(os.listdir(elsewhere)) == ["notes.txt"]


def test_an_output_file_is_replaced_only_when_it_holds_what_the_pipeline_wrote(tmp_path):
    """A first write needs nothing there; a file the owner put at an output path, or a pipeline output the owner
    edited since, fails naming it and how to proceed, and is left as it was."""
    metrics = tmp_path / "metrics" / "sft.json"
    write_text_atomic(metrics, '{"loss": 1}\n')  # a fresh clone: nothing there
    write_text_atomic(metrics, '{"loss": 0.5}\n')  # what the pipeline wrote: replaced
    assert metrics.read_text() == '{"loss": 0.5}\n'

    notes = tmp_path / "metrics" / "notes.json"
    notes.write_text("my notes\n")
    metrics.write_text('{"loss": 0.1}\n')  # edited by hand
    for path, why in ((notes, "the pipeline did not write it"), (metrics, "it changed since the pipeline wrote it")):
        with pytest.raises(ForeignPathError, match=rf"{re.escape(str(path))}: {why}.*Delete or move the file"):
            write_text_atomic(path, "{}\n")
    assert notes.read_text() == "my notes\n" and metrics.read_text() == '{"loss": 0.1}\n'


def test_an_output_file_dvc_put_back_is_replaced(tmp_path, monkeypatch):
    """A file that holds what dvc.lock records for that output (`dvc checkout`, `dvc pull`, a restore) or that lies
    in a directory the pipeline made (a DVC output restored with its marker) is replaced without a record; other
    content at a path the lock names is not."""
    monkeypatch.setattr(fsutil, "PROJECT_ROOT", tmp_path)  # the project the code belongs to
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    preferences = tmp_path / "data" / "raw" / "demo" / "preferences.jsonl"
    preferences.parent.mkdir(parents=True)
    preferences.write_text('{"prompt": "hi"}\n')
    lock = {"schema": "2.0", "stages": {"demo_data": {"outs": [{"path": "data/raw/demo/preferences.jsonl"}]}}}
    lock["stages"]["demo_data"]["outs"][0]["md5"] = hashlib.md5(b'{"prompt": "hi"}\n').hexdigest()
    (tmp_path / "dvc.lock").write_text(json.dumps(lock))  # JSON is YAML
    write_text_atomic(preferences, '{"prompt": "hello"}\n')
    assert preferences.read_text() == '{"prompt": "hello"}\n'

    restored = tmp_path / "reports" / "evaluate"
    restored.mkdir(parents=True)
    mark_made(restored, "evaluate.report_dir")
    (restored / "report.md").write_text("restored\n")
    write_text_atomic(restored / "report.md", "new\n")
    assert (restored / "report.md").read_text() == "new\n" and not (restored / WRITTEN_RECORDS).exists()

    preferences.write_text('{"prompt": "mine"}\n')
    with pytest.raises(ForeignPathError, match="the pipeline did not write it|changed since"):
        write_text_atomic(preferences, "{}\n")
    assert preferences.read_text() == '{"prompt": "mine"}\n'


def test_only_the_projects_own_lock_and_unlinked_records_vouch_for_a_file(tmp_path, monkeypatch):
    """A dvc.lock planted above a file outside the project, a linked dvc.lock, or a record directory that is a link
    to records someone wrote: none of them makes a file the pipeline did not write replaceable."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    monkeypatch.setattr(fsutil, "PROJECT_ROOT", project)
    foreign = elsewhere / "data" / "theirs.txt"
    foreign.parent.mkdir(parents=True)
    foreign.write_text("theirs\n")
    outs = [{"path": "data/theirs.txt", "md5": hashlib.md5(b"theirs\n").hexdigest()}]
    planted = json.dumps({"schema": "2.0", "stages": {"s": {"outs": outs}}})
    (elsewhere / "dvc.yaml").write_text("stages: {}\n")
    (elsewhere / "dvc.lock").write_text(planted)  # above the file, but not the project's
    with pytest.raises(ForeignPathError, match="the pipeline did not write it"):
        write_text_atomic(foreign, "mine\n")
    mine = project / "data" / "theirs.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text("theirs\n")
    (project / "dvc.lock").symlink_to(elsewhere / "dvc.lock")
    with pytest.raises(ForeignPathError, match="the pipeline did not write it"):
        write_text_atomic(mine, "mine\n")
    records = elsewhere / "records"
    records.mkdir()
    (records / "theirs.txt").write_text(hashlib.md5(b"theirs\n").hexdigest() + "\n")
    (mine.parent / WRITTEN_RECORDS).symlink_to(records, target_is_directory=True)
    with pytest.raises(ForeignPathError, match="the pipeline did not write it"):
        write_text_atomic(mine, "mine\n")
    assert foreign.read_text() == mine.read_text() == "theirs\n"


def test_writers_of_different_files_in_one_directory_keep_each_others_records(tmp_path):
    """Stages writing their own metrics file in one directory at once: each file's record survives the others'
    writes, so each is replaced again, and a file none of them wrote is still refused."""
    names = [f"stage{i}.json" for i in range(8)]

    def write_twice(name):
        for n in range(2):
            write_text_atomic(tmp_path / name, f'{{"run": {n}}}\n')

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(write_twice, names))
    for name in names:
        write_text_atomic(tmp_path / name, "{}\n")
    (tmp_path / "other.json").write_text("{}\n")
    with pytest.raises(ForeignPathError, match="other.json: the pipeline did not write it"):
        write_text_atomic(tmp_path / "other.json", "{}\n")


@pytest.mark.parametrize("killed_at", [1, 2])
def test_a_write_cut_short_leaves_its_file_recorded(tmp_path, monkeypatch, killed_at):
    """A writer killed before its record's first or second update (before or after the file's swap) leaves the
    file that stands there recorded: the next run replaces it, and a hand edit is still refused."""
    path = tmp_path / "ppo.json"
    write_text_atomic(path, "old\n")
    updates = []

    def killed(record, md5s, write=fsutil._write_record):
        updates.append(md5s)
        if len(updates) == killed_at:
            raise KeyboardInterrupt
        write(record, md5s)

    monkeypatch.setattr(fsutil, "_write_record", killed)
    with pytest.raises(KeyboardInterrupt):
        write_text_atomic(path, "new\n")
    monkeypatch.undo()
    assert path.read_text() == ("old\n" if killed_at == 1 else "new\n")
    write_text_atomic(path, "next\n")
    path.write_text("edited\n")
    with pytest.raises(ForeignPathError, match="changed since the pipeline wrote it"):
        write_text_atomic(path, "again\n")
