"""What identifies a file's or a directory's content, in one place: the md5s DVC records (`file_md5`, and
`dvc_md5s` for files and directories as `dvc repro` hashes them), the content hash the model registry tags a
model directory with (`dir_md5`), and the cheap size-and-mtime stamps of large inputs behind checkpoint resumes
(`file_stamps`, `inputs_fingerprint`)."""

from __future__ import annotations

# dvc is heavy: it is imported inside the functions that hash with its cache.
import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rlhflow.config.params import REPO_ROOT
from rlhflow.fsutil import dir_md5, file_md5  # noqa: F401 (re-exported: rlhflow needs them too)


@contextlib.contextmanager
def dvc_md5s(work_dir: str | os.PathLike) -> Iterator[Callable[[Path], str | None]]:
    """`md5(path)`: DVC's own hash of a file or directory (None when it does not exist), the value `dvc repro`
    writes in dvc.lock: a directory's is the md5 of its `.dir` listing, with .dvcignore applied. DVC's state
    db (inode and mtime -> md5, so unchanged large files are not read again) is kept in `work_dir/hash-state`."""
    from dvc.ignore import DvcIgnoreFilter
    from dvc_data.hashfile.build import build
    from dvc_data.hashfile.db import HashFileDB
    from dvc_data.hashfile.state import State
    from dvc_objects.fs import LocalFileSystem

    fs = LocalFileSystem()
    ignore = DvcIgnoreFilter(fs, str(REPO_ROOT))  # .dvcignore, as `dvc repro` applies it
    cache_dir = Path(work_dir) / "hash-state"
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


def file_stamps(paths: list[str | os.PathLike]) -> dict[str, list[int] | None]:
    """Size and modification time of each file (None when missing): a cheap fingerprint of large inputs."""
    stamps: dict[str, list[int] | None] = {}
    for path in map(Path, paths):
        stamps[str(path)] = [path.stat().st_size, path.stat().st_mtime_ns] if path.is_file() else None
    return stamps


def inputs_fingerprint(files: list[str | os.PathLike], **settings: Any) -> str:
    """What a checkpoint must have been made from to be resumed (`fsutil.prepare_checkpoint_dir`): the given
    settings (JSON values) and the stamps of the input files, as one canonical JSON text."""
    return json.dumps({**settings, "inputs": file_stamps(files)}, sort_keys=True)
