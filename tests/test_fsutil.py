"""rlhflow/fsutil.py: a file written through atomic_file appears whole or not at all, in text and in bytes; a
directory the pipeline did not make is never replaced or deleted (atomic_dir, prepare_checkpoint_dir, the removal of
stale temporary paths), and is left as it was."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys

import pytest

from rlhflow.fsutil import (
    MADE_MARKER,
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
    assert sorted(p.name for p in path.parent.iterdir()) == ["figure.png"]  # no temp file left


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
    private.write_text("{}\n")
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
