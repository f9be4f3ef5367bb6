"""Turn records in the formats users bring into the canonical columns: `prompt_messages` (chat messages), `prompt`
(plain text: the user text of a single turn, else a transcript), `chosen`, `rejected` and `source_row` (1-based, so
every message can name rows). Formats are detected from the columns: prompt/chosen/rejected (plain or TRL's
conversational form), HH dialogues (the prompt is the shared prefix) and sharegpt; demonstrations from
prompt/completion, chat `messages` or pairs' chosen responses. Wrong value types are collected over all rows and
raised as one `DataFormatError`; content problems are kept for the validation suite. The formats: docs/data.md.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from typing import Any

import pandas as pd

from rlhflow.data.errors import DataFormatError, rows_text

CANONICAL_COLUMNS = ["prompt", "prompt_messages", "chosen", "rejected", "source_row"]
FORMATS_ACCEPTED = (
    "prompt/chosen/rejected (text or TRL conversational lists of messages); "
    "chosen/rejected only (Anthropic HH dialogues '\\n\\nHuman: ...\\n\\nAssistant: ...' or message lists); "
    "conversations/chosen/rejected (sharegpt turns with from/value)"
)
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


# ---- schema detection -------------------------------------------------------------------------------


def to_preferences(rows: list[tuple[int, Any]], source: str) -> pd.DataFrame:
    """(row number, record) pairs as preference pairs, in the columns CANONICAL_COLUMNS; the format is told by the
    columns."""
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
            f"{HH_ASSISTANT!r} (Anthropic HH format) {rows_text(unparsed)}; formats accepted: {FORMATS_ACCEPTED}"
        )
    return pd.DataFrame(out, columns=CANONICAL_COLUMNS)


def to_demonstrations(rows: list[tuple[int, Any]], source: str) -> pd.DataFrame:
    """(row number, record) pairs as demonstrations, in the columns DEMONSTRATION_COLUMNS."""
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
            else to_preferences(rows, str(source))
        )
        demos = pairs.rename(columns={"chosen": "completion"}).drop(columns="rejected")
        return demos.drop_duplicates(["prompt", "completion"]).reset_index(drop=True)
    else:
        formats = (["prompt", "completion"], ["messages"], ["chosen", "rejected"])
        raise _unrecognised(str(source), "demonstrations", columns, len(rows), formats, DEMONSTRATION_FORMATS)
    return pd.DataFrame(_convert_rows(rows, convert, str(source)), columns=DEMONSTRATION_COLUMNS)


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


# ---- conversion ---------------------------------------------------------------------------------------


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
                f"{rows_text(rows)}"
                for column, rows in self.rows.items()
            ]
            raise DataFormatError(f"{source}: values of the wrong type: " + "; ".join(parts))


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
