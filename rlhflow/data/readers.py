"""Read rows from preference and demonstration data, each with its 1-based row (JSONL: line) number.

Sources: .jsonl/.jsonl.gz/.json (a list, or one object per line)/.parquet files, a directory written by
`datasets.save_to_disk`, a directory of data files, or a Hugging Face dataset name (which of these a name is:
rlhflow/data/sources.py). A JSON list is streamed, never held whole in memory; `max_rows` stops a read early. Rows come
back as they are in the file; rlhflow/data/converters.py turns them into the canonical columns.

Also `read_jsonl`/`write_jsonl`, for the project's own files (the validated splits).
"""

from __future__ import annotations

# pyarrow and datasets are imported by the readers that need them: heavy, and most data never uses them.
import codecs
import gzip
import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from rlhflow.data.errors import DataFormatError, rows_text
from rlhflow.data.sources import SourceNotFoundError, resolve_source
from rlhflow.fsutil import write_jsonl_atomic

FILE_TYPES = ".jsonl, .jsonl.gz, .json (a list of objects), .parquet"
_CHUNK = 1 << 20  # bytes read at a time from JSON files

# What one JSONL/JSON file (gzipped or not) may make this process hold: one line of JSONL or one item of a JSON list,
# and the whole file once decompressed. Both are checked while reading, so a 10 GB line packed into a small .jsonl.gz
# fails after MAX_LINE_BYTES, not once memory runs out. They guard memory, not the data: the shipped hh-rlhf pairs'
# longest line is 8 KB and the file 2 MB decompressed; a real preference pair past 16 MiB, or a file past 4 GiB (held
# in memory whole as rows, validate.max_rows of them), is not one this pipeline can train on anyway. Constants, not
# params: no setting of a run should change what reading a file may cost.
MAX_LINE_BYTES = 16 << 20
MAX_DECOMPRESSED_BYTES = 4 << 30
# Levels of lists and objects in one record: a preference row has 3 (messages: a list of objects); past Python's own
# recursion limit a deeper one would end in a RecursionError traceback instead of an error naming the row
MAX_NESTING = 32
# Unreadable lines gathered from one file before the read stops: each costs a message, and a small gzip can hold
# millions of them; the error names the first few either way
MAX_BAD_LINES = 100
# Parquet files and Arrow datasets, checked in the footer (or schema) before any data is read: leaf columns (a
# preference file has under 10) and MAX_NESTING; their bytes and values are held to MAX_DECOMPRESSED_BYTES and
# MAX_LINE_BYTES (a value, not a row: one Parquet cell, one dataset field)
MAX_COLUMNS = 1024
_BATCH_ROWS = 1024  # rows decoded at a time, checked before the next batch is read


def json_record(text: str, where: str) -> Any:
    """`text` decoded as JSON, nested at most MAX_NESTING levels; `where` ("FILE: line N") names it in the error.
    Invalid JSON, a number Python will not read among it, raises json.JSONDecodeError, for the caller to gather."""
    try:
        value = json.loads(text)
        too_deep = nesting(value) > MAX_NESTING
    except RecursionError:
        too_deep = True
    except json.JSONDecodeError:
        raise
    except ValueError as err:  # an integer past Python's digit limit (sys.get_int_max_str_digits)
        raise json.JSONDecodeError(_past_limit(err), text, 0) from None
    if too_deep:
        raise DataFormatError(
            f"{where}: nested deeper than {MAX_NESTING} levels of lists and objects (rlhflow.data.readers.MAX_NESTING)"
        )
    return value


def _past_limit(err: ValueError, item: int | None = None) -> str:
    """What a ValueError of Python's JSON decoder says of a number it will not read, without its advice."""
    where = f" (item {item})" if item is not None else ""
    return f"a number past Python's limit ({str(err).split(';')[0]}){where}"


def nesting(value: Any) -> int:
    """Levels of lists and objects in a decoded JSON value, counted up to MAX_NESTING + 1."""
    depth, level = 0, [value]
    while depth <= MAX_NESTING:
        level = [v for v in level if isinstance(v, (dict, list))]
        if not level:
            break
        depth += 1
        level = [item for v in level for item in (v.values() if isinstance(v, dict) else v)]
    return depth


def bounded_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each line of `path`, gunzipped when gzipped, within MAX_LINE_BYTES a line and
    MAX_DECOMPRESSED_BYTES in all (DataFormatError past either, naming the line)."""
    line_no = 0
    with _BoundedFile(path) as f:
        while raw := f.readline(line_no + 1):
            line_no += 1
            yield line_no, raw


def read_rows(
    source: str | os.PathLike, *, hf_split: str = "train", max_rows: int | None = None
) -> list[tuple[int, Any]]:
    """(row number, record) pairs from a file, a local dataset directory or a Hugging Face dataset name."""
    source = str(source)
    try:
        resolved = resolve_source(source)
    except SourceNotFoundError:
        raise DataFormatError(f"{source}: no such file or directory") from None
    if resolved.kind == "file":
        return read_file(resolved.path, max_rows)
    if resolved.kind == "dir" and _is_saved_dataset(resolved.path):
        return _read_dataset(_open_saved_dataset(resolved.path, hf_split), source, max_rows)
    if resolved.kind == "dir":
        return _read_data_dir(resolved.path, hf_split, max_rows)
    if resolved.kind == "package":
        raise DataFormatError(f"{source}: a packaged model (pkg:), not data: no such file or directory")
    return _read_dataset(_open_hub_dataset(resolved.name, hf_split), source, max_rows)


def write_jsonl(df: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Write a frame as JSONL atomically (temp file in the same directory, then os.replace)."""
    return write_jsonl_atomic((_jsonable(record) for record in df.to_dict(orient="records")), path)


def read_jsonl(path: str | os.PathLike) -> pd.DataFrame:
    """Read a JSONL file (for example a validated split) into a frame; lists stay Python lists."""
    path = Path(path)
    records = [record for _, record in _iter_jsonl(path, max_rows=None)]
    return pd.DataFrame.from_records(records)


# ---- files ----------------------------------------------------------------------------------------------


def read_file(path: Path, max_rows: int | None) -> list[tuple[int, Any]]:
    """(row number, record) pairs from a JSONL, JSON-list or Parquet file (gzipped or not, told by its bytes)."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"PAR1" or path.suffix.lower() == ".parquet":
        return _read_parquet(path, max_rows)
    first = _first_char(path)
    if first is None:
        raise DataFormatError(f"{path}: empty file: no rows to read")
    if first == "[":
        return list(_iter_json_array(path, max_rows))
    if first == "{":
        return list(_iter_jsonl(path, max_rows))
    raise DataFormatError(
        f"{path}: not a preference file: it starts with {first!r}; accepted files: {FILE_TYPES} "
        "(JSON must be a list of objects or one object per line)"
    )


def _open_binary(path: Path):
    with open(path, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gzipped else open(path, "rb")


class _BoundedFile:
    """A data file's bytes, gunzipped when gzipped, read within MAX_LINE_BYTES a line and MAX_DECOMPRESSED_BYTES in
    all: a line is read at most MAX_LINE_BYTES + 1 bytes at a time, so a longer one fails without being held."""

    def __init__(self, path: Path):
        self.path = path
        self.file = _open_binary(path)
        self.bytes_read = 0

    def __enter__(self) -> _BoundedFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.file.close()

    def readline(self, line_no: int) -> bytes:
        """Line `line_no` (1-based, for the error), its newline included; b"" at the end of the file."""
        raw = self.file.readline(MAX_LINE_BYTES + 1)
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            raise DataFormatError(
                f"{self.path}: line {line_no} is longer than {MAX_LINE_BYTES} bytes (rlhflow.data.readers."
                "MAX_LINE_BYTES); stopped reading it there. One line holds one record: split the file's records one "
                "per line"
            )
        self._count(len(raw), f"line {line_no}")
        return raw

    def read(self, size: int, line_no: int) -> bytes:
        chunk = self.file.read(size)
        self._count(len(chunk), f"line {line_no}")
        return chunk

    def _count(self, size: int, where: str) -> None:
        self.bytes_read += size
        if self.bytes_read > MAX_DECOMPRESSED_BYTES:
            raise DataFormatError(
                f"{self.path}: more than {MAX_DECOMPRESSED_BYTES} bytes once decompressed (rlhflow.data.readers."
                f"MAX_DECOMPRESSED_BYTES); stopped reading at {where}. Split the data into smaller files"
            )


def _first_char(path: Path) -> str | None:
    """The first non-whitespace character (BOM skipped), or None for an empty file."""
    with _BoundedFile(path) as f:
        while chunk := f.read(4096, 1):
            text = chunk.decode("utf-8", errors="replace").lstrip("\ufeff \t\r\n")
            if text:
                return text[0]
    return None


def _check_max_rows(path: Any, count: int, max_rows: int | None, where: str) -> None:
    if max_rows is not None and count > max_rows:
        raise DataFormatError(
            f"{path}: more than max_rows={max_rows} rows (stopped reading at {where}); "
            "raise validate.max_rows or pass a smaller file"
        )


class BadLines:
    """A file's unreadable lines, gathered to be named in one error (`raise_if_any`); the MAX_BAD_LINES-th stops the
    read at once."""

    def __init__(self, path: Path):
        self.path = path
        self.lines: list[int] = []
        self.problems: list[str] = []

    def add(self, line_no: int, problem: str) -> None:
        self.lines.append(line_no)
        self.problems.append(f"line {line_no}: {problem}")
        if len(self.lines) >= MAX_BAD_LINES:
            raise DataFormatError(
                f"{self._message()}; stopped reading at line {line_no}, the {MAX_BAD_LINES}th unreadable line "
                "(rlhflow.data.readers.MAX_BAD_LINES)"
            )

    def raise_if_any(self) -> None:
        if self.lines:
            raise DataFormatError(self._message())

    def _message(self) -> str:
        shown = "; ".join(self.problems[:5]) + (
            f"; ... ({len(self.problems) - 5} more)" if len(self.problems) > 5 else ""
        )
        return f"{self.path}: {len(self.problems)} unreadable line(s) {rows_text(self.lines)}: {shown}"


def _iter_jsonl(path: Path, max_rows: int | None) -> Iterator[tuple[int, Any]]:
    """Yield (line number, object) for each line; gather bad lines (blank ones too: a JSON line holds one record, and
    a file of blank lines must stop at the bad-line bound) and raise once."""
    bad = BadLines(path)
    count = 0
    offset = 0
    for line_no, raw in bounded_lines(path):
        line_offset, offset = offset, offset + len(raw)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            bad.add(line_no, f"not UTF-8 (byte 0x{raw[err.start]:02x} at byte offset {line_offset + err.start})")
            continue
        if line_no == 1:
            text = text.lstrip("\ufeff")
        if not text.strip():
            bad.add(line_no, "blank (one JSON object a line)")
            continue
        count += 1
        _check_max_rows(path, count, max_rows, f"line {line_no}")
        try:
            obj = json_record(text, f"{path}: line {line_no}")
        except json.JSONDecodeError as err:
            bad.add(line_no, f"invalid JSON ({err.msg} at column {err.colno})")
            continue
        if not isinstance(obj, dict):
            bad.add(line_no, f"expected a JSON object, got {type(obj).__name__}")
            continue
        if not bad.lines:
            yield line_no, obj
    bad.raise_if_any()


class _TextStream:
    """Decodes a binary file as UTF-8 in chunks, naming the line and byte of any undecodable byte."""

    def __init__(self, path: Path):
        self.path = path
        self.file = _BoundedFile(path)
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.bytes_read = 0
        self.newlines_read = 0

    def read(self, size: int) -> str:
        chunk = self.file.read(size, self.newlines_read + 1)
        try:
            text = self.decoder.decode(chunk, final=not chunk)
        except UnicodeDecodeError as err:
            # err.start counts from the bytes the decoder held back plus this chunk; at most 3 held back.
            held = len(err.object) - len(chunk)
            pos = err.start - held
            line = self.newlines_read + chunk[: max(pos, 0)].count(b"\n") + 1
            raise DataFormatError(
                f"{self.path}: not UTF-8: byte 0x{err.object[err.start]:02x} at byte offset "
                f"{self.bytes_read + pos} (line {line}); save the file as UTF-8"
            ) from None
        self.bytes_read += len(chunk)
        self.newlines_read += chunk.count(b"\n")
        return text

    def close(self) -> None:
        self.file.close()


_DECODER = json.JSONDecoder()


def _item_problem(obj: Any, item: int, too_deep: bool = False) -> str | None:
    """What makes item `item` of a JSON list no record: nested too deep (or past Python's reach), or not an object."""
    if too_deep or nesting(obj) > MAX_NESTING:
        return f"item {item} nests lists and objects deeper than MAX_NESTING={MAX_NESTING} levels"
    return None if isinstance(obj, dict) else f"item {item} is a {type(obj).__name__}, expected an object"


def _iter_json_array(path: Path, max_rows: int | None) -> Iterator[tuple[int, Any]]:
    """Yield (item number, object) from a JSON list without holding the whole file in memory."""
    stream = _TextStream(path)
    buf, pos, eof, lines_dropped = "", 0, False, 0

    def refill(size: int = _CHUNK) -> None:
        nonlocal buf, pos, eof, lines_dropped
        lines_dropped += buf.count("\n", 0, pos)
        text = stream.read(size)
        eof = eof or not text
        buf, pos = buf[pos:] + text, 0

    def next_char() -> str:
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n\ufeff":
                pos += 1
            if pos < len(buf) or eof:
                return buf[pos] if pos < len(buf) else ""
            refill()

    def fail(problem: str, at: int) -> DataFormatError:
        line = lines_dropped + buf.count("\n", 0, at) + 1
        return DataFormatError(f"{path}: invalid JSON on line {line}: {problem}")

    try:
        if next_char() != "[":
            raise fail("expected '[' (a JSON list of objects)", pos)
        pos += 1
        item = 0
        while True:
            if (c := next_char()) == "]":
                return
            if item > 0:
                if c != ",":
                    raise fail(f"expected ',' or ']' after item {item}, found {c or 'end of file'!r}", pos)
                pos += 1
                next_char()
            item += 1
            _check_max_rows(path, item, max_rows, f"item {item}")
            while True:  # a value cut by the chunk boundary fails or ends at the buffer's end: read on
                try:
                    obj, end = _DECODER.raw_decode(buf, pos)
                    if (end < len(buf) or eof) and end - pos <= MAX_LINE_BYTES:  # a longer one fails below
                        break
                except json.JSONDecodeError as err:
                    if eof:
                        raise fail(f"{err.msg} (item {item})", err.pos) from None
                except (RecursionError, ValueError) as err:  # deeper than Python reads; a number past its digit limit
                    deep = _item_problem(None, item, too_deep=True)
                    raise fail(deep if isinstance(err, RecursionError) else _past_limit(err, item), pos) from None
                if len(buf) - pos > MAX_LINE_BYTES:  # characters: at least as many bytes
                    raise fail(f"item {item} is longer than MAX_LINE_BYTES={MAX_LINE_BYTES} bytes", pos)
                refill(max(_CHUNK, len(buf)))
            if problem := _item_problem(obj, item):
                raise fail(problem, pos)
            pos = end
            yield item, obj
    finally:
        stream.close()


def _read_parquet(path: Path, max_rows: int | None) -> list[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several types for corrupt files
        raise DataFormatError(f"{path}: not a readable Parquet file ({err})") from None
    footer = parquet.metadata
    _check_max_rows(path, footer.num_rows, max_rows, "the Parquet footer's row count")
    _check_columns(path, parquet.schema_arrow)
    _check_parquet_sizes(path, footer)
    return _bounded_rows(path, parquet.iter_batches(batch_size=_BATCH_ROWS))


def _check_columns(source: Any, schema) -> None:
    """At most MAX_COLUMNS leaf columns, nested at most MAX_NESTING levels (a row is one, as a JSON record is)."""
    depth, leaves, level = 1, 0, list(schema.types)
    while depth <= MAX_NESTING and leaves <= MAX_COLUMNS:
        leaves += sum(not t.num_fields for t in level)
        level = [t.field(i).type for t in level for i in range(t.num_fields)]  # in lists, structs, maps
        if not level:
            break
        depth += 1
    if leaves > MAX_COLUMNS:
        raise DataFormatError(
            f"{source}: more than MAX_COLUMNS={MAX_COLUMNS} columns (rlhflow.data.readers.MAX_COLUMNS)"
        )
    if depth > MAX_NESTING:
        raise DataFormatError(
            f"{source}: its columns nest lists and structs deeper than {MAX_NESTING} levels "
            "(rlhflow.data.readers.MAX_NESTING)"
        )


def _check_parquet_sizes(path: Path, footer) -> None:
    """The footer's uncompressed sizes: at most MAX_DECOMPRESSED_BYTES in all, and no column chunk so large that
    one of its values must pass MAX_LINE_BYTES (a chunk of one row, say)."""
    groups = [footer.row_group(i) for i in range(footer.num_row_groups)]
    total = sum(group.total_byte_size for group in groups)
    if total > MAX_DECOMPRESSED_BYTES:
        raise DataFormatError(
            f"{path}: {total} bytes once decompressed, more than {MAX_DECOMPRESSED_BYTES} (rlhflow.data.readers."
            "MAX_DECOMPRESSED_BYTES); split the data into smaller files"
        )
    first_row = 1
    for group in groups:
        for chunk in (group.column(i) for i in range(group.num_columns)):
            if chunk.total_uncompressed_size > MAX_LINE_BYTES * max(group.num_rows, 1):
                raise DataFormatError(_long_value(path, chunk.path_in_schema, first_row, group.num_rows))
        first_row += group.num_rows


def _long_value(source: Any, column: str, first_row: int, rows: int) -> str:
    return (
        f"{source}: column {column!r} holds a value longer than {MAX_LINE_BYTES} bytes (rlhflow.data.readers."
        f"MAX_LINE_BYTES) in rows {first_row} to {first_row + rows - 1}; nothing past them was read"
    )


def _bounded_rows(source: Any, batches) -> list[tuple[int, Any]]:
    """(row number, record) pairs from Arrow record batches, each checked before it becomes Python objects: no
    value longer than MAX_LINE_BYTES, at most MAX_DECOMPRESSED_BYTES in all."""
    rows: list[Any] = []
    total = 0
    for batch in batches:
        for name, column in zip(batch.schema.names, batch.columns):
            if _longest_value(column) > MAX_LINE_BYTES:
                raise DataFormatError(_long_value(source, name, len(rows) + 1, batch.num_rows))
        total += batch.nbytes
        if total > MAX_DECOMPRESSED_BYTES:
            raise DataFormatError(
                f"{source}: more than {MAX_DECOMPRESSED_BYTES} bytes once decoded (rlhflow.data.readers."
                f"MAX_DECOMPRESSED_BYTES); stopped reading at row {len(rows) + batch.num_rows}. Split the data into "
                "smaller files"
            )
        rows.extend(batch.to_pylist())  # pyarrow (not pandas) keeps nulls as None and nested values as lists/dicts
    return list(enumerate(rows, start=1))


def _longest_value(array) -> int:
    """Bytes of the longest string or binary value anywhere in an Arrow array, nested ones included."""
    import pyarrow as pa
    import pyarrow.compute as pc

    longest, level = 0, [array]
    while level:
        children = []
        for a in level:
            t = a.type
            if (
                pa.types.is_string(t)
                or pa.types.is_large_string(t)
                or pa.types.is_binary(t)
                or pa.types.is_large_binary(t)
            ):
                longest = max(longest, pc.max(pc.binary_length(a)).as_py() or 0)
            elif pa.types.is_dictionary(t):
                children.append(a.dictionary)
            elif pa.types.is_map(t):
                children += [a.keys, a.items]
            elif pa.types.is_struct(t):
                children += a.flatten()
            elif t.num_fields:  # the list types
                children.append(a.flatten())
        level = children
    return longest


# ---- Hugging Face datasets ------------------------------------------------------------------------


def _is_saved_dataset(path: Path) -> bool:
    """A directory `Dataset.save_to_disk` or `DatasetDict.save_to_disk` wrote (Arrow files, memory-mapped)."""
    return (path / "dataset_dict.json").exists() or (path / "state.json").exists()


def _open_saved_dataset(path: Path, split: str):
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataFormatError(f"{path}: no split {split!r}; splits found: {', '.join(ds)}")
        ds = ds[split]
    return ds


# ---- a directory of data files ----------------------------------------------------------------------------------

# A file's split, by a word of its name as Hugging Face's loader names them (train.jsonl, data/test-00000.parquet)
SPLIT_WORDS = {"train": "train", "test": "test", "validation": "validation", "valid": "validation", "dev": "validation"}


def _read_data_dir(path: Path, split: str, max_rows: int | None) -> list[tuple[int, Any]]:
    """The rows of a directory's data files (JSONL, JSON lists, Parquet; gzipped or not), each file read by this
    module's bounded readers, never converted whole first (Hugging Face's loader builds an Arrow cache of every
    file before any bound: a 196 KB gzip cost it 1.5 GB). Files named after a split (train, test, validation) are
    that split's; without such names every file is train. Rows are numbered across the files in name order."""
    files = sorted(f for f in path.rglob("*") if f.is_file() and not _hidden(f.relative_to(path)))
    others = [f.relative_to(path).as_posix() for f in files if not f.name.lower().endswith(DATA_SUFFIXES)]
    if others or not files:
        found = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise DataFormatError(
            f"{path}: a data directory holds {FILE_TYPES} files only; " + (f"found {found}" if found else "it has none")
        )
    by_split = {f: _split_of(f.relative_to(path)) for f in files}
    named = any(by_split.values())
    chosen = [f for f in files if (by_split[f] or "train") == split] if named else (files if split == "train" else [])
    if not chosen:
        found = sorted({s or "train" for s in by_split.values()})
        raise DataFormatError(f"{path}: no split {split!r}; splits found: {', '.join(found)}")
    rows: list[Any] = []
    for f in chosen:  # each file within max_rows, and the rows so far too (at most twice max_rows held)
        rows += [record for _, record in read_file(f, max_rows)]
        _check_max_rows(path, len(rows), max_rows, f"the end of {f.relative_to(path).as_posix()}")
    return list(enumerate(rows, start=1))


DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")


def _hidden(rel: Path) -> bool:
    return any(part.startswith((".", "_")) for part in rel.parts)


def _split_of(rel: Path) -> str | None:
    """The split a file's path names by a word of it (train-00000-of-00001.parquet: train), or None."""
    words = [w for part in rel.parts for w in re.split(r"[-_.\s]+", part.lower())]
    return next((SPLIT_WORDS[w] for w in words if w in SPLIT_WORDS), None)


def _open_hub_dataset(name: str, split: str):
    import datasets

    try:
        return datasets.load_dataset(name, split=split)
    except Exception as err:  # network, missing dataset or split: say which source failed
        raise DataFormatError(
            f"{name}: not a file or directory, and loading it as a Hugging Face dataset (split {split!r}) failed: {err}"
        ) from err


def _read_dataset(ds, source: str, max_rows: int | None) -> list[tuple[int, Any]]:
    _check_max_rows(source, len(ds), max_rows, "the dataset's row count")
    table = ds.with_format("arrow")[:]  # the rows the dataset holds (a selection's, in its order), memory-mapped
    _check_columns(source, table.schema)
    return _bounded_rows(source, table.to_batches(max_chunksize=_BATCH_ROWS))


def _jsonable(value: Any) -> Any:
    """Plain JSON values: numpy scalars/arrays unwrapped, NaN written as null."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, str):  # numpy arrays and scalars
        return _jsonable(value.tolist())
    if isinstance(value, float) and math.isnan(value):
        return None
    return value
