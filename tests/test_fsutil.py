"""rlhflow/fsutil.py: a file written through atomic_file appears whole or not at all, in text and in bytes."""

from __future__ import annotations

import pytest

from rlhflow.fsutil import atomic_file


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
