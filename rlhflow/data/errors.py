"""The one error the data readers and converters raise, and how its messages name rows and values."""

from __future__ import annotations

from collections.abc import Iterable


class DataFormatError(ValueError):
    """The input cannot be read as preference data; the message names the file, the problem and the rows."""


def rows_text(rows: Iterable[int], limit: int = 10) -> str:
    """'(row 3)', '(rows 1, 2, 5)', '(rows 1, ..., 10 and 4 more)': the rows a message names."""
    rows = list(rows)
    shown = ", ".join(str(r) for r in rows[:limit])
    more = f" and {len(rows) - limit} more" if len(rows) > limit else ""
    return f"(row{'s' if len(rows) > 1 else ''} {shown}{more})"


def excerpt(value: object, limit: int = 60) -> str:
    """`value`'s repr, cut to `limit` characters: enough to recognise it in a message, never all of it."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
