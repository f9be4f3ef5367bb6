"""Atomic writes: an interrupted stage never leaves a half output that DVC would cache or a stage would read."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def file_md5(path: str | os.PathLike) -> str:
    """The md5 of a file's bytes (what DVC 3 records for a file output)."""
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def dir_md5(path: str | os.PathLike) -> str:
    """Content hash of a directory: md5 over its files' relative paths and md5s (names and bytes, not times).
    Not DVC's directory hash (`dvc_md5s`): this one ignores no file and needs no DVC."""
    root = Path(path)
    h = hashlib.md5()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(f"{file.relative_to(root).as_posix()}\0{file_md5(file)}\n".encode())
    return h.hexdigest()


def save_for_file(path: str | os.PathLike, record: dict, *, data_file: str | os.PathLike) -> None:
    """Write `record` as JSON to `path`, marked with the file it was measured on (its name and md5)."""
    marked = {**record, "data_file": Path(data_file).name, "data_md5": file_md5(data_file)}
    Path(path).write_text(json.dumps(marked) + "\n")


def saved_for_file(path: str | os.PathLike, *, data_file: str | os.PathLike, **expected: Any) -> dict | None:
    """The record `save_for_file` wrote to `path`, when it was measured on `data_file` as it is now (the same md5)
    and has each `expected` key's value; None otherwise (nothing saved, another file, other settings)."""
    path = Path(path)
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    if record.get("data_md5") != file_md5(data_file) or any(record.get(k) != v for k, v in expected.items()):
        return None
    return record


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_temps(final: str | os.PathLike) -> list[Path]:
    """Remove the temporary siblings of `final` (`.<name>.tmp-<pid>...`, `.<name>.old-<pid>`) left by a
    process that was killed before it could clean up; those of live processes are kept. A process killed
    between the two renames of `atomic_dir` leaves no `final` but its `.old-<pid>`: that previous output
    is put back."""
    final = Path(final)
    removed = []
    for stale in sorted(final.parent.glob(f".{final.name}.*")):
        match = re.fullmatch(rf"\.{re.escape(final.name)}\.(tmp|old)-(\d+)(?:-.*)?", stale.name)
        if not match or _pid_alive(int(match.group(2))):
            continue
        if match.group(1) == "old" and not final.exists():
            os.replace(stale, final)
        else:
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
            removed.append(stale)
    return removed


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling dir; on success it replaces `final`, on error it is removed and `final`
    (the previous good output) is left untouched. Temp dirs of killed earlier runs are removed first."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, *, binary: bool = False) -> Iterator[IO]:
    """A UTF-8 text file handle (a bytes one with `binary`) whose content appears at `path` only once the block
    succeeds (a unique temp file in the same directory, then os.replace); on error the temp file is removed.
    Temp files of killed earlier writers are removed first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    # not mkstemp: its files are private (0600), and outputs must get the usual permissions (umask)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "xb") if binary else open(tmp, "x", encoding="utf-8") as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_file(path) as f:
        f.write(text)


def write_json_atomic(path: str | os.PathLike, payload: Any) -> None:
    write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True, default=float) + "\n")


def prepare_checkpoint_dir(ckpt_dir: str | os.PathLike, fingerprint: str) -> Path:
    """Keep the checkpoints of an interrupted run made from the same inputs (`fingerprint`, any text: the
    stages use `rlhfops.hashing.inputs_fingerprint`) so it can resume; drop anything else. The fingerprint is
    kept in `inputs.json` inside the dir."""
    ckpt_dir = Path(ckpt_dir)
    marker = ckpt_dir / "inputs.json"
    if ckpt_dir.exists() and (not marker.exists() or marker.read_text() != fingerprint):
        shutil.rmtree(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(marker, fingerprint)
    return ckpt_dir
