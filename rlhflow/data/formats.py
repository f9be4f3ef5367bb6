"""Read preference data and demonstrations in the formats users bring, into one canonical table.

This ties the two halves together: rlhflow/data/readers.py reads rows (with their row numbers) from files, local
dataset directories and the Hugging Face Hub; rlhflow/data/converters.py turns them into the canonical columns
(CANONICAL_COLUMNS for preference pairs, DEMONSTRATION_COLUMNS for demonstrations), detecting the format from the
columns.

Structural problems (unreadable files, unknown schemas, wrong value types) raise a `DataFormatError` naming the
file, the problem and the rows. Content problems (nulls, empty texts, chosen == rejected, duplicates, long texts)
are kept: the validation suite reports them with their rows.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from rlhflow.data.converters import (
    CANONICAL_COLUMNS,
    DEMONSTRATION_COLUMNS,
    DEMONSTRATION_FORMATS,
    FORMATS_ACCEPTED,
    to_demonstrations,
    to_preferences,
)
from rlhflow.data.errors import DataFormatError
from rlhflow.data.readers import FILE_TYPES, read_file, read_rows

__all__ = [
    "CANONICAL_COLUMNS",
    "DEMONSTRATION_COLUMNS",
    "DEMONSTRATION_FORMATS",
    "FILE_TYPES",
    "FORMATS_ACCEPTED",
    "DataFormatError",
    "load_demonstrations",
    "load_preferences",
]


def load_preferences(
    source: str | os.PathLike, *, hf_split: str = "train", max_rows: int | None = None
) -> pd.DataFrame:
    """Read preference pairs from a file, a local dataset directory or a Hugging Face dataset name."""
    source = str(source)
    rows = read_rows(source, hf_split=hf_split, max_rows=max_rows)
    if not rows:
        raise DataFormatError(f"{source}: empty file: no rows to read")
    return to_preferences(rows, source)


def load_demonstrations(source: str | os.PathLike, *, max_rows: int | None = None) -> pd.DataFrame:
    """Read demonstrations for supervised fine-tuning from a file, into the columns DEMONSTRATION_COLUMNS: prompt,
    prompt_messages, completion, source_row. Rows are prompt/completion (text or messages), chat `messages` (the
    last one, the assistant's, is the completion), or preference pairs in any format `load_preferences` reads
    (the chosen response is the completion; a pair repeated for one prompt gives one demonstration)."""
    path = Path(os.path.expanduser(str(source)))
    if not path.is_file():
        raise DataFormatError(f"{source}: no such file")
    rows = read_file(path, max_rows)
    if not rows:
        raise DataFormatError(f"{source}: empty file: no rows to read")
    return to_demonstrations(rows, str(source))
