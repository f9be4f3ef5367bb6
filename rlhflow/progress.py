"""Progress lines while a stage works: at most one every `PROGRESS_SECONDS` per stage, written with print, so that a
Prefect run (log_prints) shows them in its log as well as the terminal does. Progress bars stay on the terminal only;
these lines are what the Prefect UI shows of a stage between its start and its end."""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def _progress_seconds(name: str = "RLHFLOW_PROGRESS_SECONDS", default: float = 30.0) -> float:
    """The interval: $RLHFLOW_PROGRESS_SECONDS (0: a line at every step) where set, else `default`."""
    text = os.environ.get(name)
    try:
        seconds = default if text is None else float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # NaN and negative values too
        raise ValueError(f"${name} must be a number of seconds >= 0, got {text!r}")
    return seconds


PROGRESS_SECONDS = _progress_seconds()


class ProgressLines:
    """`lines(text)` prints "<what>: <text>" when `every` seconds have passed since the last line (or the start);
    `text` may be a function, called only when a line is printed."""

    def __init__(self, what: str, every: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.what, self.clock = what, clock
        self.every = PROGRESS_SECONDS if every is None else every
        self.last = clock()

    def __call__(self, text: str | Callable[[], str]) -> None:
        now = self.clock()
        if now - self.last < self.every:
            return
        self.last = now
        print(f"{self.what}: {text() if callable(text) else text}", flush=True)
