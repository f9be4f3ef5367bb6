"""Atomic, durable writes: an interrupted stage (or a machine that lost power) never leaves a half output that DVC
would cache or a stage would read. Every directory the pipeline makes holds a marker (MADE_MARKER); only such
directories are replaced or deleted, so a mistyped path never costs a file the pipeline did not write. A single output
file is replaced only when it holds what the pipeline wrote there (its record, WRITTEN_RECORDS) or what DVC's lock
records for it."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import yaml


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


MADE_MARKER = ".rlhflow-made"  # in every directory the pipeline makes: only such directories are replaced or deleted


class ForeignPathError(ValueError):
    """An output or checkpoint setting points at something the pipeline did not make: it is neither replaced nor
    deleted."""


def is_made(directory: str | os.PathLike) -> bool:
    """Whether the pipeline made `directory` (it holds the marker)."""
    return (Path(directory) / MADE_MARKER).is_file()


def mark_made(directory: str | os.PathLike, setting: str) -> None:
    """Mark `directory` as the pipeline's; the text says what made it (the same bytes every run: outputs stay
    reproducible)."""
    marker = Path(directory) / MADE_MARKER
    if not marker.is_file():
        marker.write_text(json.dumps({"made_by": "rlhflow", "setting": setting}) + "\n")


def refuse_foreign(path: str | os.PathLike, setting: str) -> None:
    """Raise ForeignPathError unless `path` is missing, an empty directory or a directory the pipeline made."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ForeignPathError(
            f"{setting}={path}: a file is there, not a directory the pipeline made; it is left as it was. "
            f"Point {setting} at another path."
        )
    if path.is_dir() and not is_made(path) and any(path.iterdir()):
        raise ForeignPathError(
            f"{setting}={path}: the directory is not empty and holds no {MADE_MARKER}, so the pipeline did not make "
            f"it and will neither replace nor delete it; it is left as it was. Point {setting} at another path, or "
            "move the directory away (an output of a pipeline version from before the marker: delete it, or mark it "
            f"with `touch {path / MADE_MARKER}`)."
        )


def _remove_entry(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def remove_made(directory: str | os.PathLike) -> bool:
    """Delete `directory` when the pipeline made it, its marker last (a deletion cut short leaves a directory still
    marked, which the next run deletes); a missing or unmarked one is left as it is. True when deleted."""
    directory = Path(directory)
    if directory.is_symlink() or not is_made(directory):
        return False
    for entry in directory.iterdir():
        if entry.name != MADE_MARKER:
            _remove_entry(entry)
    (directory / MADE_MARKER).unlink()
    directory.rmdir()
    return True


def _fsync(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a directory's entries (a rename into it) durable."""
    _fsync(directory)


def fsync_tree(root: str | os.PathLike) -> None:
    """Flush every file and directory under `root` to disk: after a crash a renamed output is whole, not a directory
    of empty or cut files."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            if not os.path.islink(os.path.join(dirpath, name)):
                _fsync(os.path.join(dirpath, name))
        _fsync(dirpath)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _temp_name(final: Path, kind: str) -> Path:
    return final.with_name(f".{final.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove_stale_temps(final: str | os.PathLike) -> list[Path]:
    """Remove the temporary siblings of `final` (`.<name>.tmp-<pid>-...`, `.<name>.old-<pid>-...`) left by a
    process that was killed before it could clean up; those of live processes are kept, and so is anything of that
    name the pipeline did not mark as its own. A process killed between the two renames of `atomic_dir` leaves no
    `final` but its `.old-<pid>`: that previous output is put back."""
    final = Path(final)
    removed = []
    for stale in sorted(final.parent.glob(f".{final.name}.*")):
        match = re.fullmatch(rf"\.{re.escape(final.name)}\.(tmp|old)-(\d+)(?:-.*)?", stale.name)
        if not match or _pid_alive(int(match.group(2))) or stale.is_symlink() or not is_made(stale):
            continue
        if match.group(1) == "old" and not final.exists():
            os.replace(stale, final)
        elif remove_made(stale):
            removed.append(stale)
    return removed


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, *, setting: str) -> Iterator[Path]:
    """Yield a temporary sibling dir, marked as the pipeline's; on success it replaces `final` (flushed to disk
    first), on error it is removed and `final` (the previous good output) is left untouched. Temp dirs of killed
    earlier runs are removed first. `final` must be missing, empty or made by the pipeline: anything else is refused
    (ForeignPathError naming `setting`, the params key) and left as it was."""
    final = Path(final)
    _refuse_unswappable(final, setting)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final)
    tmp = _temp_name(final, "tmp")
    tmp.mkdir()
    mark_made(tmp, setting)
    try:
        yield tmp
        _refuse_unswappable(final, setting)  # again: something may have been put there meanwhile
        fsync_tree(tmp)
    except BaseException:
        remove_made(tmp)
        raise
    old = _temp_name(final, "old")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old.exists() and not remove_made(old):
        old.rmdir()  # the empty directory that stood there


def _refuse_unswappable(final: Path, setting: str) -> None:
    if final.is_symlink():  # the swap would replace the link, not write where it points
        raise ForeignPathError(f"{setting}={final}: a symbolic link; point {setting} at a directory instead")
    refuse_foreign(final, setting)


_FILE_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}


def _refuse_unwritable_file(path: Path) -> None:
    """Raise ForeignPathError, naming `path`, where an output file must not be written: at a symbolic link (replacing
    it would drop the link; writing through it, change what it points at), at anything but a regular file (a
    directory, a FIFO, a device), or through a linked directory other than those the working directory lies in
    (writing there lands wherever the link points)."""
    with contextlib.suppress(FileNotFoundError):
        mode = os.lstat(path).st_mode
        if stat.S_ISLNK(mode):
            raise ForeignPathError(f"{path} is a symbolic link: an output file is written only where no link stands")
        if not stat.S_ISREG(mode):
            kind = _FILE_KINDS.get(stat.S_IFMT(mode), "a device")
            raise ForeignPathError(f"{path} is {kind}, not a regular file: an output file is written only over a file")
    workspace = {Path.cwd(), *Path.cwd().parents}  # where the workspace itself lives may be reached by a link
    for parent in Path(os.path.abspath(path)).parents:
        if parent.resolve() in workspace:
            break
        if parent.is_symlink():
            raise ForeignPathError(
                f"{path}: its directory {parent} is a symbolic link: an output file is written only where no link "
                "stands on its path"
            )


@contextlib.contextmanager
def atomic_file(
    path: str | os.PathLike, *, binary: bool = False, private: bool = False, output: bool = True
) -> Iterator[IO]:
    """A UTF-8 text file handle (a bytes one with `binary`) whose content appears at `path` only once the block
    succeeds and the file is on disk (written in a marked temp dir beside it, flushed, then os.replace); on error
    the temp dir is removed. Temp dirs of killed earlier writers are removed first. An output file is written only
    where the pipeline may replace what stands (`_replaceable_md5`), and its md5 is recorded; `output=False` is for
    a file of the user's that the caller rewrites keeping its content (an append): no record is needed or kept.
    `private`: the file is its owner's alone (0600) from the moment it exists, whatever the umask and the file it
    replaces."""
    path = Path(path)
    _refuse_unwritable_file(path)
    recorded = output and not is_made(path.parent)  # a directory the pipeline made is all its own
    if recorded:
        _replaceable_md5(path)  # before the work: a refusal should not cost a stage's run
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    # not mkstemp: its files are private (0600), and outputs must get the usual permissions (umask)
    tmp_dir = _temp_name(path, "tmp")
    tmp_dir.mkdir()
    try:
        mark_made(tmp_dir, "a temporary file")
        tmp = tmp_dir / path.name
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o666)
        with open(fd, "wb") if binary else open(fd, "w", encoding="utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        _keep_narrower_mode(tmp, path)
        if recorded:
            _replace_recorded(tmp, path)
        else:
            os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        remove_made(tmp_dir)


# beside the output files the pipeline wrote in a directory it did not make (metrics/, data/raw/demo/): one record
# per file, `WRITTEN_RECORDS/<name>`, holding the md5 of what it wrote. Not inside any DVC output: DVC hashes none.
WRITTEN_RECORDS = ".rlhflow-written"


def _record_path(path: Path) -> Path:
    return path.parent / WRITTEN_RECORDS / path.name


def _recorded_md5s(path: Path) -> set[str]:
    record = _record_path(path)
    if record.parent.is_symlink() or record.is_symlink():  # a record reached through a link vouches for nothing
        return set()
    with contextlib.suppress(FileNotFoundError):
        return set(record.read_text().split())
    return set()


# The project whose dvc.lock vouches for its outputs: the one this code belongs to (a DVC experiment's temporary
# copy holds its own), never a dvc.lock found above a path elsewhere
PROJECT_ROOT = Path(__file__).resolve().parents[1]


def _dvc_lock_md5s(path: Path) -> set[str]:
    """The md5s that the project's dvc.lock records for `path` as an output: what `dvc checkout`, `dvc pull`, `dvc
    repro` and a restore (which writes the run's lock entries) put there. A path outside the project (its links
    resolved) has none, and a linked dvc.lock vouches for nothing."""
    path, lock = Path(path).resolve(), PROJECT_ROOT / "dvc.lock"
    if not path.is_relative_to(PROJECT_ROOT) or lock.is_symlink() or not lock.is_file():
        return set()
    try:  # BaseLoader: every value a string, as DVC wrote it (an all-digit md5 is no number)
        stages = yaml.load(lock.read_text(), Loader=yaml.BaseLoader)["stages"]
        outs = [out for entry in stages.values() for out in entry.get("outs", [])]
    except (yaml.YAMLError, KeyError, TypeError, AttributeError):
        return set()  # no lock DVC could read either: it vouches for nothing
    rel = path.relative_to(PROJECT_ROOT).as_posix()
    return {out.get("md5") for out in outs if isinstance(out, dict) and out.get("path") == rel}


def _replaceable_md5(path: Path) -> str | None:
    """The md5 of the file at `path` (None when there is none) when the pipeline may replace it: it holds what the
    pipeline last wrote there (its record) or what DVC's lock records for that output. Anything else raises
    ForeignPathError naming the path, the file left as it was."""
    if not path.exists():
        return None
    md5 = file_md5(path)
    if md5 in _recorded_md5s(path) or md5 in _dvc_lock_md5s(path):
        return md5
    why = "it changed since the pipeline wrote it" if _recorded_md5s(path) else "the pipeline did not write it"
    raise ForeignPathError(
        f"{path}: {why} (neither {_record_path(path)} nor dvc.lock records its content); an output file is replaced "
        "only when it holds what the pipeline or DVC put there, so it is left as it was. Delete or move the file, "
        "then run again."
    )


def _replace_recorded(new: Path, path: Path) -> None:
    """Put `new` at `path` and record its md5. The record's directory is locked meanwhile, so two writers of one
    file each check what the other wrote; while the file is swapped the record holds both md5s, so a crash at any
    point leaves the file there recorded."""
    record = _record_path(path)
    with directory_lock(record.parent):
        old_md5 = _replaceable_md5(path)  # again: something may have been put there meanwhile
        new_md5 = file_md5(new)
        _write_record(record, {old_md5, new_md5} - {None})
        os.replace(new, path)
        _write_record(record, {new_md5})


def _write_record(record: Path, md5s: set[str]) -> None:
    with atomic_file(record, output=False) as f:
        f.writelines(f"{md5}\n" for md5 in sorted(md5s))


@contextlib.contextmanager
def directory_lock(directory: Path) -> Iterator[None]:
    """An exclusive flock on `directory` itself (its inode stays while the files in it are replaced), released when
    the block ends or the process dies."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _keep_narrower_mode(new: Path, old: Path) -> None:
    """A file replaced gives its group and others no access it did not give them: one its owner made private (0600)
    stays private. The owner's own bits are the new file's (a read-only output, as DVC may leave one, is not
    inherited)."""
    with contextlib.suppress(FileNotFoundError):
        os.chmod(new, stat.S_IMODE(os.stat(new).st_mode) & (stat.S_IMODE(os.stat(old).st_mode) | stat.S_IRWXU))


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_file(path) as f:
        f.write(text)


def write_json_atomic(path: str | os.PathLike, payload: Any) -> None:
    write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True, default=float) + "\n")


def write_jsonl_atomic(records: Iterable[dict], path: str | os.PathLike) -> Path:
    """JSON Lines, one record a line (non-ASCII text kept as it is), written whole or not at all."""
    with atomic_file(path) as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return Path(path)


def prepare_checkpoint_dir(ckpt_dir: str | os.PathLike, fingerprint: str, *, setting: str) -> Path:
    """Keep the checkpoints of an interrupted run made from the same inputs (`fingerprint`, any text: the
    stages use `rlhfops.hashing.inputs_fingerprint`) so it can resume; drop anything else. The fingerprint is
    kept in `inputs.json` inside the dir. A directory the pipeline did not make (not empty, no marker) is refused
    (ForeignPathError naming `setting`, the params key) and left as it was."""
    ckpt_dir = Path(ckpt_dir)
    refuse_foreign(ckpt_dir, setting)
    inputs = ckpt_dir / "inputs.json"
    if is_made(ckpt_dir) and (not inputs.exists() or inputs.read_text() != fingerprint):
        for entry in ckpt_dir.iterdir():  # the marker stays: a clearing cut short leaves the directory still ours
            if entry.name != MADE_MARKER:
                _remove_entry(entry)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    mark_made(ckpt_dir, setting)
    write_text_atomic(inputs, fingerprint)
    return ckpt_dir
