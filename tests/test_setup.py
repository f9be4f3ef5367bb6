"""What `make setup` installs: the exact versions of requirements.lock (written by `make lock` from requirements*.txt),
so `make run` and `make test` set up the same stack every time."""

from __future__ import annotations

import re

import pytest
from conftest import REPO

PIN = re.compile(r"^([A-Za-z0-9_.\[\]-]+?)(?:\[[^\]]*\])?==([^\s;#]+)", re.M)


def pins(text: str) -> dict[str, str]:
    """name -> version of every `name==version` line (extras dropped, names normalised as pip normalises them)."""
    return {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in PIN.findall(text)}


@pytest.mark.parametrize(
    "lock, sources",
    [
        ("requirements.lock", ["requirements.txt", "requirements-team.txt", "requirements-dev.txt"]),
        ("requirements-label.lock", ["requirements-label.txt"]),
    ],
)
def test_the_lock_holds_every_pinned_requirement_at_its_pin(lock, sources):
    locked = pins((REPO / lock).read_text())
    assert len(locked) > 100 if lock == "requirements.lock" else len(locked) > 50
    for source in sources:
        for name, version in pins((REPO / source).read_text()).items():
            assert locked.get(name) == version, (
                f"{source} pins {name}=={version}, {lock} has {locked.get(name)}: `make lock`"
            )


def test_setup_installs_the_lock():
    makefile = (REPO / "Makefile").read_text()
    assert "$(UV_INSTALL) --python $(BIN)/python -r $(LOCK)" in makefile
    assert "$(UV_INSTALL) --python $(LABEL_VENV)/bin/python -r $(LABEL_LOCK)" in makefile
    assert "-r requirements.txt" not in makefile.split("lock:")[0]  # set-up never resolves the ranges itself
