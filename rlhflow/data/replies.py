"""A server's reply read as it arrives, within a size and a whole-reply time: the bounded input of readers.py, for
the network. HTTP clients bound each read only, so a server that floods or drips a byte per read timeout would hold
a run's memory or time without end. The judge's client, Label Studio's and MLflow's (rlhflow/evaluation/judges.py,
rlhfops/labeling.py, rlhfops/store_replies.py) read through `read_within` and name the bound in their own errors."""

from __future__ import annotations

import time
from collections.abc import Iterable


class PastBoundsError(Exception):
    """A reply ran past its byte bound (`size`: True) or its time bound; reading stopped there. The message says
    which: "passed 1,024 bytes", "took over 30 s"."""

    def __init__(self, message: str, size: bool):
        super().__init__(message)
        self.size = size


def read_within(chunks: Iterable[bytes], max_bytes: int, seconds: float) -> bytes:
    """The chunks joined, each checked as it arrives: past `max_bytes` in all, or after `seconds` from the first
    read, PastBoundsError."""
    deadline, body = time.monotonic() + seconds, bytearray()
    for chunk in chunks:
        body += chunk
        if len(body) > max_bytes:
            raise PastBoundsError(f"passed {max_bytes:,} bytes", size=True)
        if time.monotonic() > deadline:
            raise PastBoundsError(f"took over {seconds:.0f} s", size=False)
    return bytes(body)
