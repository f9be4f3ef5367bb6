"""Where a model or a data set comes from, decided in one place: a local file or directory, a model shipped inside a
Python package (`pkg:<package>`), or a Hugging Face Hub id.

A spec naming an existing file or directory is local, whatever it looks like. A spec that names nothing but looks
like a path (it starts with `.`, `/` or `~`, ends in a data or model file suffix, or has more than two
`/`-separated parts) is a missing local path: an error here, never a Hub download. Anything else
(`Anthropic/hh-rlhf`, `HuggingFaceTB/SmolLM2-135M-Instruct`) is a Hub id. Nothing here reads the network or a
package: the callers load what is resolved (rlhflow/models/loading.py for models, rlhflow/data/readers.py for data).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

PACKAGE_PREFIX = "pkg:"
# names ending in these are files, never Hub ids: a missing one is a typo in a path, not something to download
LOCAL_SUFFIXES = frozenset({".jsonl", ".json", ".gz", ".parquet", ".ndjson", ".gguf"})


class SourceNotFoundError(FileNotFoundError):
    """The spec has the form of a local path, and nothing is there."""

    def __init__(self, spec: str, path: Path):
        super().__init__(f"{spec}: no such file or directory")
        self.spec = spec
        self.path = path


@dataclass(frozen=True)
class Source:
    """A resolved spec: `path` for a local file or dir (`~` expanded), `name` for a package or a Hub id."""

    kind: Literal["file", "dir", "package", "hub"]
    spec: str
    path: Path | None = None
    name: str | None = None


def looks_local(spec: str) -> bool:
    """Whether a spec has the form of a local path (so is never sent to the Hub)."""
    return (
        spec.startswith((".", "/", "~"))
        or Path(spec).suffix.lower() in LOCAL_SUFFIXES
        or os.sep in spec.strip("/").split("/", 1)[-1]  # a Hub id is `name` or `owner/name`
    )


def resolve_source(spec: str | os.PathLike) -> Source:
    """What kind of source a spec (a model or data path from params.yaml) names; `SourceNotFoundError` for a missing
    local path."""
    spec = str(spec)
    if spec.startswith(PACKAGE_PREFIX):
        return Source("package", spec, name=spec[len(PACKAGE_PREFIX) :])
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        return Source("dir", spec, path=path)
    if path.exists():
        return Source("file", spec, path=path)
    if looks_local(spec):
        raise SourceNotFoundError(spec, path)
    return Source("hub", spec, name=spec)
