"""Read preference data in the formats users bring, into one canonical table.

Canonical columns (one row per preference pair):
  prompt_messages  list of {"role": "system"|"user"|"assistant", "content": str}
  prompt           plain text: the user text for a single user turn, else a transcript
                   ("Human: ...\\n\\nAssistant: ...\\n\\nHuman: ...\\n\\nAssistant:")
  chosen, rejected the two response texts
  source_row       1-based row (JSONL: line) number in the input, so every message can name rows

Formats, detected from the columns:
  prompt/chosen/rejected  plain strings, or TRL's conversational form (lists of messages)
  HH dialogues            only chosen/rejected, each a whole "\\n\\nHuman: ...\\n\\nAssistant: ..." dialogue
                          (or a list of messages); the prompt is their shared prefix
  sharegpt                conversations = [{"from", "value"}, ...]; chosen/rejected = one turn each
Sources: .jsonl/.jsonl.gz/.json (a list, or one object per line)/.parquet files, a directory written by
`datasets.save_to_disk`, a directory of data files, or a Hugging Face dataset name.

The reader rejects structural problems (unreadable files, unknown schemas, wrong value types) with a
`DataFormatError`. Content problems (nulls, empty texts, chosen == rejected, duplicates, long texts)
are kept: the validation suite reports them with their rows.
"""

from __future__ import annotations

# pyarrow and datasets are imported by the readers that need them: heavy, and most data never uses them.
import codecs
import gzip
import json
import math
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from rlhflow.fsutil import atomic_file

CANONICAL_COLUMNS = ["prompt", "prompt_messages", "chosen", "rejected", "source_row"]
FORMATS_ACCEPTED = (
    "prompt/chosen/rejected (text or TRL conversational lists of messages); "
    "chosen/rejected only (Anthropic HH dialogues '\\n\\nHuman: ...\\n\\nAssistant: ...' or message lists); "
    "conversations/chosen/rejected (sharegpt turns with from/value)"
)
FILE_TYPES = ".jsonl, .jsonl.gz, .json (a list of objects), .parquet"
DEMONSTRATION_COLUMNS = ["prompt", "prompt_messages", "completion", "source_row"]
DEMONSTRATION_FORMATS = (
    "prompt/completion (text or lists of messages); messages (a chat ending in the assistant's turn); "
    f"or preference pairs, whose chosen responses are used ({FORMATS_ACCEPTED})"
)

HH_ASSISTANT = "\n\nAssistant:"
_HH_TURN = re.compile(r"\n\n(Human|Assistant):")
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "chatgpt": "assistant",
    "system": "system",
}
_TRANSCRIPT_LABELS = {"user": "Human", "assistant": "Assistant", "system": "System"}
_CHUNK = 1 << 20  # bytes read at a time from JSON files


class DataFormatError(ValueError):
    """The input cannot be read as preference data; the message names the file, the problem and the rows."""


# ---- public API ---------------------------------------------------------------------------------------


def load_preferences(
    source: str | os.PathLike, *, hf_split: str = "train", max_rows: int | None = None
) -> pd.DataFrame:
    """Read preference pairs from a file, a local dataset directory or a Hugging Face dataset name."""
    source = str(source)
    path = Path(os.path.expanduser(source))
    if path.is_file():
        rows = _read_file(path, max_rows)
    elif path.is_dir():
        rows = _read_dataset(_open_local_dataset(path, hf_split), source, max_rows)
    elif path.suffix.lower() in {".jsonl", ".json", ".gz", ".parquet", ".ndjson"} or source.startswith((".", "/", "~")):
        raise DataFormatError(f"{source}: no such file or directory")
    else:
        rows = _read_dataset(_open_hub_dataset(source, hf_split), source, max_rows)
    if not rows:
        raise DataFormatError(f"{source}: empty file: no rows to read")
    return _to_canonical(rows, source)


def load_demonstrations(source: str | os.PathLike, *, max_rows: int | None = None) -> pd.DataFrame:
    """Read demonstrations for supervised fine-tuning from a file, into the columns DEMONSTRATION_COLUMNS: prompt,
    prompt_messages, completion, source_row. Rows are prompt/completion (text or messages), chat `messages` (the
    last one, the assistant's, is the completion), or preference pairs in any format `load_preferences` reads
    (the chosen response is the completion; a pair repeated for one prompt gives one demonstration)."""
    path = Path(os.path.expanduser(str(source)))
    if not path.is_file():
        raise DataFormatError(f"{source}: no such file")
    rows = _read_file(path, max_rows)
    if not rows:
        raise DataFormatError(f"{source}: empty file: no rows to read")
    columns = list(dict.fromkeys(key for _, record in rows for key in record))
    present = set(columns)
    if {"prompt", "completion"} <= present:
        convert = _from_prompt_completion
    elif "messages" in present:
        convert = _from_messages
    elif {"chosen", "rejected"} <= present:
        # the validated splits keep each prompt's messages; other preference files are read as validate reads them
        pairs = (
            pd.DataFrame([record for _, record in rows], columns=CANONICAL_COLUMNS)
            if set(CANONICAL_COLUMNS) <= present
            else _to_canonical(rows, str(source))
        )
        demos = pairs.rename(columns={"chosen": "completion"}).drop(columns="rejected")
        return demos.drop_duplicates(["prompt", "completion"]).reset_index(drop=True)
    else:
        formats = (["prompt", "completion"], ["messages"], ["chosen", "rejected"])
        raise _unrecognised(str(source), "demonstrations", columns, len(rows), formats, DEMONSTRATION_FORMATS)
    return pd.DataFrame(_convert_rows(rows, convert, str(source)), columns=DEMONSTRATION_COLUMNS)


def write_jsonl(df: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Write a frame as JSONL atomically (temp file in the same directory, then os.replace)."""
    with atomic_file(path) as f:
        for record in df.to_dict(orient="records"):
            f.write(json.dumps(_jsonable(record), ensure_ascii=False) + "\n")
    return Path(path)


def read_jsonl(path: str | os.PathLike) -> pd.DataFrame:
    """Read a JSONL file (for example a validated split) into a frame; lists stay Python lists."""
    path = Path(path)
    records = [record for _, record in _iter_jsonl(path, max_rows=None)]
    return pd.DataFrame.from_records(records)


# ---- files ----------------------------------------------------------------------------------------------


def _read_file(path: Path, max_rows: int | None) -> list[tuple[int, Any]]:
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


def _first_char(path: Path) -> str | None:
    """The first non-whitespace character (BOM skipped), or None for an empty file."""
    with _open_binary(path) as f:
        while chunk := f.read(4096):
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


def _iter_jsonl(path: Path, max_rows: int | None) -> Iterator[tuple[int, Any]]:
    """Yield (line number, object) for each non-blank line; gather bad lines and raise once."""
    problems: list[str] = []
    bad_lines: list[int] = []
    count = 0
    offset = 0
    with _open_binary(path) as f:
        for line_no, raw in enumerate(f, start=1):
            line_offset, offset = offset, offset + len(raw)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                bad_lines.append(line_no)
                problems.append(
                    f"line {line_no}: not UTF-8 (byte 0x{raw[err.start]:02x} at byte offset {line_offset + err.start})"
                )
                continue
            if line_no == 1:
                text = text.lstrip("\ufeff")
            if not text.strip():
                continue
            count += 1
            _check_max_rows(path, count, max_rows, f"line {line_no}")
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as err:
                bad_lines.append(line_no)
                problems.append(f"line {line_no}: invalid JSON ({err.msg} at column {err.colno})")
                continue
            if not isinstance(obj, dict):
                bad_lines.append(line_no)
                problems.append(f"line {line_no}: expected a JSON object, got {type(obj).__name__}")
                continue
            if not problems:
                yield line_no, obj
    if problems:
        shown = "; ".join(problems[:5]) + (f"; ... ({len(problems) - 5} more)" if len(problems) > 5 else "")
        raise DataFormatError(f"{path}: {len(problems)} unreadable line(s) {_rows_text(bad_lines)}: {shown}")


class _TextStream:
    """Decodes a binary file as UTF-8 in chunks, naming the line and byte of any undecodable byte."""

    def __init__(self, path: Path):
        self.path = path
        self.file = _open_binary(path)
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.bytes_read = 0
        self.newlines_read = 0

    def read(self, size: int) -> str:
        chunk = self.file.read(size)
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


def _iter_json_array(path: Path, max_rows: int | None) -> Iterator[tuple[int, Any]]:
    """Yield (item number, object) from a JSON list without holding the whole file in memory."""
    stream = _TextStream(path)
    decoder = json.JSONDecoder()
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
            c = next_char()
            if c == "]":
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
                    obj, end = decoder.raw_decode(buf, pos)
                    if end < len(buf) or eof:
                        break
                except json.JSONDecodeError as err:
                    if eof:
                        raise fail(f"{err.msg} (item {item})", err.pos) from None
                refill(max(_CHUNK, len(buf)))
            if not isinstance(obj, dict):
                raise fail(f"item {item} is a {type(obj).__name__}, expected an object", pos)
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
    _check_max_rows(path, parquet.metadata.num_rows, max_rows, "the Parquet footer's row count")
    # pyarrow (not pandas) keeps nulls as None and nested values as lists/dicts.
    return list(enumerate(parquet.read().to_pylist(), start=1))


# ---- Hugging Face datasets ------------------------------------------------------------------------


def _open_local_dataset(path: Path, split: str):
    import datasets

    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataFormatError(f"{path}: no split {split!r}; splits found: {', '.join(ds)}")
            ds = ds[split]
        return ds
    try:
        return datasets.load_dataset(str(path), split=split)
    except (ValueError, FileNotFoundError) as err:
        raise DataFormatError(f"{path}: cannot load the directory as a dataset ({err})") from None


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
    return list(enumerate(ds.to_list(), start=1))


# ---- schema detection and conversion -------------------------------------------------------------


class _TypeProblems:
    """Collects wrong-typed values per column so one error names every offending row."""

    def __init__(self):
        self.rows: dict[str, list[int]] = {}
        self.found: dict[str, set[str]] = {}
        self.expected: dict[str, str] = {}

    def add(self, column: str, row: int, value: Any, expected: str) -> None:
        self.rows.setdefault(column, []).append(row)
        self.found.setdefault(column, set()).add(type(value).__name__)
        self.expected.setdefault(column, expected)

    def raise_if_any(self, source: str) -> None:
        if self.rows:
            parts = [
                f"column {column}: got {'/'.join(sorted(self.found[column]))}, expected {self.expected[column]} "
                f"{_rows_text(rows)}"
                for column, rows in self.rows.items()
            ]
            raise DataFormatError(f"{source}: values of the wrong type: " + "; ".join(parts))


def _to_canonical(rows: list[tuple[int, Any]], source: str) -> pd.DataFrame:
    columns = list(dict.fromkeys(key for _, record in rows for key in record))
    present = set(columns)
    if {"conversations", "chosen", "rejected"} <= present:
        convert = _from_sharegpt
    elif {"prompt", "chosen", "rejected"} <= present:
        convert = _from_prompt_chosen_rejected
    elif {"chosen", "rejected"} <= present:
        convert = _from_dialogues
    else:
        formats = (["prompt", "chosen", "rejected"], ["conversations", "chosen", "rejected"])
        raise _unrecognised(source, "schema", columns, len(rows), formats, FORMATS_ACCEPTED)
    out = _convert_rows(rows, convert, source)
    unparsed = [r["source_row"] for r in out if r.pop("_no_shared_prompt", False)]
    if unparsed:
        raise DataFormatError(
            f"{source}: no prompt column, and chosen/rejected do not share a prompt ending in "
            f"{HH_ASSISTANT!r} (Anthropic HH format) {_rows_text(unparsed)}; formats accepted: {FORMATS_ACCEPTED}"
        )
    return pd.DataFrame(out, columns=CANONICAL_COLUMNS)


def _unrecognised(
    source: str, what: str, columns: list[str], n_rows: int, formats: Iterable[list[str]], accepted: str
) -> DataFormatError:
    """The error for rows of no accepted format: what is missing against the closest one (the first when none is
    close)."""
    present = set(columns)
    wanted = max(formats, key=lambda cols: len(present.intersection(cols)))
    missing = [c for c in wanted if c not in present]
    return DataFormatError(
        f"{source}: unrecognised {what}: missing column{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
        f"in all {n_rows} rows (columns found: {', '.join(columns) or '(none)'}); formats accepted: {accepted}"
    )


def _convert_rows(rows: list[tuple[int, Any]], convert, source: str) -> list[dict]:
    """`convert(record, row, problems)` over the rows, each result with its `source_row`; rows it cannot convert
    are collected and raised as one DataFormatError naming them."""
    problems = _TypeProblems()
    out = []
    for row, record in rows:
        converted = convert(record, row, problems)
        if converted is not None:
            converted["source_row"] = row
            out.append(converted)
    problems.raise_if_any(source)
    return out


def _is_null(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _text(record: dict, column: str, row: int, problems: _TypeProblems) -> str | None:
    """A text cell: str kept, null kept (validation reports it), anything else is a type problem."""
    value = record.get(column)
    if _is_null(value) or isinstance(value, str):
        return None if _is_null(value) else value
    problems.add(column, row, value, "text")
    return None


def _messages(value: Any, column: str, row: int, problems: _TypeProblems, role_key="role", content_key="content"):
    """A list of chat messages in canonical form, or None after noting a type problem."""
    if not isinstance(value, list):
        problems.add(column, row, value, "text or a list of messages")
        return None
    messages = []
    for message in value:
        if isinstance(message, dict) and role_key not in message and "from" in message:
            role_key, content_key = "from", "value"  # sharegpt turns inside a conversational column
        role = _SHAREGPT_ROLES.get(str(message.get(role_key, "")).lower()) if isinstance(message, dict) else None
        content = message.get(content_key) if isinstance(message, dict) else None
        if role is None or not (isinstance(content, str) or content is None):
            problems.add(column, row, message, f"messages with {role_key}/{content_key}")
            return None
        messages.append({"role": role, "content": content or ""})
    return messages


def _response(value: Any, column: str, row: int, problems: _TypeProblems) -> str | None:
    """A response given as text, one message, or a list of messages (TRL conversational)."""
    if _is_null(value) or isinstance(value, str):
        return None if _is_null(value) else value
    if isinstance(value, dict):
        value = [value]
    messages = _messages(value, column, row, problems)
    if messages is None:
        return None
    return _render_turns(messages)


def render_prompt(messages: list[dict]) -> str:
    """Plain-text prompt: the user text for one user turn, else a transcript ending in 'Assistant:'."""
    if len(messages) == 1 and messages[0]["role"] == "user":
        return messages[0]["content"]
    return _render_turns(messages) + "\n\nAssistant:"


def _render_turns(messages: list[dict]) -> str:
    if len(messages) == 1:
        return messages[0]["content"]
    return "\n\n".join(f"{_TRANSCRIPT_LABELS[m['role']]}: {m['content']}" for m in messages)


def _from_prompt_chosen_rejected(record: dict, row: int, problems: _TypeProblems) -> dict | None:
    return {
        **_prompt(record.get("prompt"), row, problems),
        "chosen": _response(record.get("chosen"), "chosen", row, problems),
        "rejected": _response(record.get("rejected"), "rejected", row, problems),
    }


def _prompt(value: Any, row: int, problems: _TypeProblems) -> dict:
    """A prompt given as text or as messages: its `prompt` (plain text; None when null) and `prompt_messages`."""
    if _is_null(value):
        return {"prompt": None, "prompt_messages": []}
    if isinstance(value, str):
        return {"prompt": value, "prompt_messages": [{"role": "user", "content": value}]}
    messages = _messages(value, "prompt", row, problems)
    return {"prompt": render_prompt(messages) if messages else None, "prompt_messages": messages or []}


def _from_prompt_completion(record: dict, row: int, problems: _TypeProblems) -> dict | None:
    return {
        **_prompt(record.get("prompt"), row, problems),
        "completion": _response(record.get("completion"), "completion", row, problems),
    }


def _from_messages(record: dict, row: int, problems: _TypeProblems) -> dict | None:
    """A chat ending in the assistant's turn: the turns before it are the prompt, its content the completion."""
    value = record.get("messages")
    messages = None if _is_null(value) else _messages(value, "messages", row, problems)
    if messages is None:
        return None if not _is_null(value) else {"prompt": None, "prompt_messages": [], "completion": None}
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        problems.add("messages", row, value, "a chat of at least two messages ending in the assistant's")
        return None
    return {
        "prompt": render_prompt(messages[:-1]),
        "prompt_messages": messages[:-1],
        "completion": messages[-1]["content"],
    }


def _from_sharegpt(record: dict, row: int, problems: _TypeProblems) -> dict | None:
    conversation = _messages(record.get("conversations"), "conversations", row, problems, "from", "value")
    if conversation is None:
        return None
    system = record.get("system")
    if isinstance(system, str) and system.strip():
        conversation = [{"role": "system", "content": system}] + conversation
    return {
        "prompt": render_prompt(conversation) if conversation else None,
        "prompt_messages": conversation,
        "chosen": _response(record.get("chosen"), "chosen", row, problems),
        "rejected": _response(record.get("rejected"), "rejected", row, problems),
    }


def _from_dialogues(record: dict, row: int, problems: _TypeProblems) -> dict | None:
    """Implicit prompt: chosen and rejected are whole dialogues; the prompt is their shared prefix."""
    chosen, rejected = record.get("chosen"), record.get("rejected")
    if isinstance(chosen, list) or isinstance(rejected, list):
        return _from_message_dialogues(chosen, rejected, row, problems)
    chosen = _text(record, "chosen", row, problems)
    rejected = _text(record, "rejected", row, problems)
    texts = [t for t in (chosen, rejected) if t and t.strip()]
    if not texts:
        return {"prompt": None, "prompt_messages": [], "chosen": chosen, "rejected": rejected}
    # With one side null or empty (a content problem), the other side alone gives the prompt.
    shared = os.path.commonprefix(texts) if len(texts) == 2 else texts[0]
    cut = shared.rfind(HH_ASSISTANT)
    if cut < 0:
        return {"_no_shared_prompt": True}
    cut += len(HH_ASSISTANT)
    prompt_messages = parse_hh_dialogue(shared[:cut])
    return {
        "prompt": render_prompt(prompt_messages),
        "prompt_messages": prompt_messages,
        "chosen": chosen[cut:].strip() if chosen and chosen.strip() else chosen,
        "rejected": rejected[cut:].strip() if rejected and rejected.strip() else rejected,
    }


def _from_message_dialogues(chosen: Any, rejected: Any, row: int, problems: _TypeProblems) -> dict | None:
    """TRL's implicit-prompt conversational form: the shared leading messages are the prompt."""
    chosen_msgs = _messages(chosen, "chosen", row, problems) if not _is_null(chosen) else []
    rejected_msgs = _messages(rejected, "rejected", row, problems) if not _is_null(rejected) else []
    if chosen_msgs is None or rejected_msgs is None:
        return None
    shared = 0
    while shared < min(len(chosen_msgs), len(rejected_msgs)) - 1 and chosen_msgs[shared] == rejected_msgs[shared]:
        shared += 1
    if not chosen_msgs or not rejected_msgs:  # one side null: all but its last message is the prompt
        shared = max(len(chosen_msgs), len(rejected_msgs)) - 1
    prompt_messages = (chosen_msgs or rejected_msgs)[:shared]
    if not prompt_messages:
        return {"_no_shared_prompt": True}
    return {
        "prompt": render_prompt(prompt_messages),
        "prompt_messages": prompt_messages,
        "chosen": _render_turns(chosen_msgs[shared:]) if chosen_msgs else None,
        "rejected": _render_turns(rejected_msgs[shared:]) if rejected_msgs else None,
    }


def parse_hh_dialogue(text: str) -> list[dict]:
    """Split '\\n\\nHuman: ...\\n\\nAssistant: ...' into messages; the trailing empty 'Assistant:' is the cue."""
    parts = _HH_TURN.split("\n\n" + text.lstrip("\n"))
    messages = []
    if parts[0].strip():  # text before the first marker: treat as the user's
        messages.append({"role": "user", "content": parts[0].strip()})
    for label, content in zip(parts[1::2], parts[2::2]):
        messages.append({"role": "user" if label == "Human" else "assistant", "content": content.strip()})
    if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
        messages.pop()
    return messages


# ---- helpers ---------------------------------------------------------------------------------------


def _rows_text(rows: Iterable[int], limit: int = 10) -> str:
    rows = list(rows)
    shown = ", ".join(str(r) for r in rows[:limit])
    more = f" and {len(rows) - limit} more" if len(rows) > limit else ""
    return f"(row{'s' if len(rows) > 1 else ''} {shown}{more})"


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
