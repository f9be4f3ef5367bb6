"""A server's reply read as it arrives, within a size and a whole-reply time: the bounded input of readers.py, for
the network. HTTP clients bound each read only, so a server that floods or drips a byte per read timeout would hold
a run's memory or time without end. The judge's client, Label Studio's, MLflow's and Prefect's
(rlhflow/evaluation/judging.py, rlhfops/labeling.py, rlhfops/store_replies.py, rlhfops/prefect_replies.py) read
through `read_within` or a `ReplyBound` and name the bound in their own errors."""

from __future__ import annotations

import time
from collections.abc import Iterable


class PastBoundsError(Exception):
    """A reply ran past its byte bound (`size`: True) or its time bound; reading stopped there. The message says
    which: "passed 1,024 bytes", "took over 30 s"."""

    def __init__(self, message: str, size: bool):
        super().__init__(message)
        self.size = size


class ReplyBound:
    """A reply's bounds as its chunks arrive: `add` each one; past `max_bytes` in all, or after `seconds` from the
    bound's making, PastBoundsError. `body`: what was added."""

    def __init__(self, max_bytes: int, seconds: float):
        self.max_bytes, self.seconds = max_bytes, seconds
        self.deadline, self.body = time.monotonic() + seconds, bytearray()

    def add(self, chunk: bytes) -> None:
        self.body += chunk
        if len(self.body) > self.max_bytes:
            raise PastBoundsError(f"passed {self.max_bytes:,} bytes", size=True)
        if time.monotonic() > self.deadline:
            raise PastBoundsError(f"took over {self.seconds:.0f} s", size=False)


def read_within(chunks: Iterable[bytes], max_bytes: int, seconds: float) -> bytes:
    """The chunks joined, each checked as it arrives (ReplyBound, from the first read)."""
    bound = ReplyBound(max_bytes, seconds)
    for chunk in chunks:
        bound.add(chunk)
    return bytes(bound.body)
