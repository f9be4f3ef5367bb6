"""Labels on the policy's own answers, as preference pairs (docs/feedback.md).

A round sends pairs of answers to one prompt (the policy's and the SFT model's, in random order) to people; each
pair has an id made from its texts. What comes back is a label per annotator and pair: `a`, `b`, `tie` or `skip`.
Both files only grow: a pair or label once written is never dropped, so a restarted round resends nothing and loses
nothing. A pair becomes a preference pair (chosen, rejected) when its labels name one side and no label names the
other; ties and skips stay in the labels file and never become pairs; a pair labelled `a` by one annotator and `b`
by another (or by the same one, relabelled: the latest label of an annotator counts) is a conflict, reported and
left out.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

import pandas as pd

from rlhflow.data.errors import DataFormatError, excerpt
from rlhflow.data.readers import MAX_LINE_BYTES, BadLines, bounded_lines, json_record
from rlhflow.fsutil import atomic_file, directory_lock

LABELS = ("a", "b", "tie", "skip")
SOURCES = ("human", "ai")  # who labelled: people, or an AI judge on the same pairs (RLAIF)
PAIR_FIELDS = ("pair_id", "prompt", "prompt_messages", "answer_a", "answer_b", "policy_side", "policy_run_id")
LABEL_FIELDS = ("pair_id", "label", "annotator", "labelled_at", "source")
# What a label's texts may hold: a comment a person types, ids and a time. A label is so at most some 60 KB as a line
# (6 bytes a character, escaped), far inside the readers' MAX_LINE_BYTES, and the file stays readable however many
# megabytes a comment in the labeling tool holds.
MAX_COMMENT_CHARS = 10_000
MAX_FIELD_CHARS = 100
# Characters that end a line for str.splitlines and some JSON Lines readers, though JSON keeps them raw inside a
# string: written escaped, so a line of the file is one record for every reader.
LINE_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


class FeedbackError(ValueError):
    """Pairs or labels the pipeline cannot use: the message names the problem and the rows."""


def pair_id(prompt: str, policy_answer: str, reference_answer: str) -> str:
    """A pair's id: its texts' digest, so the same pair sampled twice is sent once."""
    digest = hashlib.sha256(json.dumps([prompt, policy_answer, reference_answer]).encode()).hexdigest()
    return digest[:20]


def new_pairs(
    prompts: Sequence[dict],
    policy_answers: Sequence[str],
    reference_answers: Sequence[str],
    *,
    seed: int,
    policy_run_id: str,
    classes: tuple[Sequence[str], Sequence[str]] | None = None,
) -> list[dict]:
    """Pairs to label: per prompt row (`prompt`, `prompt_messages`), the policy's and the reference's answers in an
    order drawn from `seed`, so that the annotator cannot tell which is which. Pairs of two equal answers are left
    out: no label can prefer one. `classes`: the policy's and the reference's answer classes (ended, cut,
    degenerate: rlhflow.evaluation.answers), kept per side (answer_a_class, answer_b_class) with `both_ended`."""
    rng = random.Random(seed)
    pairs = []
    for i, (row, policy, reference) in enumerate(zip(prompts, policy_answers, reference_answers, strict=True)):
        side = rng.choice("ab")
        if policy.strip() == reference.strip():
            continue
        first, second = (policy, reference) if side == "a" else (reference, policy)
        pair = {
            "pair_id": pair_id(row["prompt"], policy, reference),
            "prompt": row["prompt"],
            "prompt_messages": row.get("prompt_messages") or [{"role": "user", "content": row["prompt"]}],
            "answer_a": first,
            "answer_b": second,
            "policy_side": side,
            "policy_run_id": policy_run_id,
        }
        if classes is not None:
            of_a, of_b = (classes[0][i], classes[1][i]) if side == "a" else (classes[1][i], classes[0][i])
            pair |= {"answer_a_class": of_a, "answer_b_class": of_b, "both_ended": of_a == of_b == "ended"}
        pairs.append(pair)
    return pairs


def read_records(path: str | os.PathLike, fields: Sequence[str]) -> list[dict]:
    """The JSON lines of `path` (none when it is missing or empty); a line that is not an object with `fields` fails,
    naming the file and the lines."""
    path = Path(path)
    if not path.exists():
        return []
    records, bad = [], BadLines(path)
    # line by line within the readers' bounds (bytes a line, bytes in all, nesting, bad lines), as every input is read
    try:
        for number, raw in bounded_lines(path):
            if not raw.strip():
                bad.add(number, "blank")
                continue
            try:
                record = json_record(raw.decode("utf-8"), f"{path}: line {number}")
            except UnicodeDecodeError:
                bad.add(number, "not UTF-8")
                continue
            except json.JSONDecodeError as err:
                bad.add(number, f"not JSON ({err.msg})")
                continue
            missing = [f for f in fields if not isinstance(record, dict) or f not in record]
            if missing:
                bad.add(number, f"no {', '.join(missing)}")
            else:
                records.append(record)
        bad.raise_if_any()
    except DataFormatError as err:
        raise FeedbackError(str(err)) from None
    return records


def label_problem(label: dict) -> str | None:
    """Why `label` may not enter the labels file (None: it may): a text field of another type or length, a comment
    over MAX_COMMENT_CHARS, a label or source outside LABELS and SOURCES."""
    for field in ("pair_id", "annotator", "labelled_at"):
        value = label.get(field)
        if not isinstance(value, str) or not 0 < len(value) <= MAX_FIELD_CHARS:
            return f"its {field} {excerpt(value)} is not a text of 1 to {MAX_FIELD_CHARS} characters"
    comment = label.get("comment", "")
    if not isinstance(comment, str) or len(comment) > MAX_COMMENT_CHARS:
        size = f"{len(comment)} characters" if isinstance(comment, str) else type(comment).__name__
        return f"its comment ({size}) is not a text of at most {MAX_COMMENT_CHARS} characters (MAX_COMMENT_CHARS)"
    for field, allowed in (("label", LABELS), ("source", SOURCES)):
        if label.get(field) not in allowed:
            return f"its {field} {excerpt(label.get(field))} is not one of {', '.join(allowed)}"
    return None


def json_line(record: dict) -> str:
    """`record` as one line of JSON Lines: non-ASCII text kept, the characters some readers take for a line break
    escaped (LINE_BREAKS)."""
    line = json.dumps(record, ensure_ascii=False, sort_keys=True)
    for char, escaped in LINE_BREAKS.items():
        line = line.replace(char, escaped)
    return line


def label_key(label: dict) -> tuple[str, str, str, str]:
    """What makes a label one: its pair, annotator, source and time (a later relabelling is a new label)."""
    return label["pair_id"], str(label["annotator"]), label["source"], str(label["labelled_at"])


def append_records(path: str | os.PathLike, records: Iterable[dict], key, *, private: bool = False) -> int:
    """Append the records whose `key` the file does not hold yet, rewriting the file atomically (a crash leaves
    the old file whole); returns how many were added. Existing rows are kept as they are, and two processes that
    append at once (two collects, a sample beside a collect) each see the other's rows: the read and the write
    hold the directory's lock. Each record is one line (`json_line`) that read_records reads back as it was; one
    longer than the readers' MAX_LINE_BYTES fails before anything is written. `private`: the file is its owner's
    alone (0600), as the labels are."""
    path = Path(path)
    with directory_lock(path.parent):
        held = {key(record) for record in read_records(path, ())}
        existing = path.read_bytes().decode("utf-8") if path.exists() else ""
        added = []
        for record in records:
            if key(record) not in held:
                held.add(key(record))
                added.append(json_line(record))
                if len(added[-1].encode()) >= MAX_LINE_BYTES:
                    raise FeedbackError(
                        f"{path}: the record {excerpt(key(record))} is longer than the readers' MAX_LINE_BYTES "
                        f"({MAX_LINE_BYTES} bytes) as a line; nothing written"
                    )
        if added:
            text = existing if not existing or existing.endswith("\n") else existing + "\n"
            with atomic_file(path, private=private, output=False) as f:  # the user's file: its rows are kept
                f.write(text + "\n".join(added) + "\n")
    return len(added)


def check_pairs(pairs: Sequence[dict]) -> None:
    """Every pair's id is its texts' (`pair_id`, recomputed): a pair whose prompt or answers were edited after it was
    sent (into a held-out conversation, say) keeps no label of the pair that was labelled."""
    forged = []
    for row, pair in enumerate(pairs, start=1):
        policy, reference = (pair["answer_a"], pair["answer_b"])[:: 1 if pair["policy_side"] == "a" else -1]
        if pair_id(pair["prompt"], policy, reference) != pair["pair_id"]:
            forged.append(f"row {row}: pair {pair['pair_id']!r}")
    if forged:
        raise FeedbackError(
            f"{len(forged)} pair(s) whose id is not their texts' (changed after sampling): {'; '.join(forged[:10])}"
        )


def check_labels(labels: Sequence[dict], pairs: Sequence[dict]) -> None:
    """Every label names a pair the pipeline sent, with a known label and source; else an error naming the rows."""
    sent = {p["pair_id"] for p in pairs}
    problems = []
    for row, label in enumerate(labels, start=1):
        if label["pair_id"] not in sent:
            problems.append(f"row {row}: pair {label['pair_id']!r} was never sent")
        elif label["label"] not in LABELS:
            problems.append(f"row {row}: label {label['label']!r} is not one of {', '.join(LABELS)}")
        elif label["source"] not in SOURCES:
            problems.append(f"row {row}: source {label['source']!r} is not one of {', '.join(SOURCES)}")
    if problems:
        raise FeedbackError(f"{len(problems)} label(s) the pipeline cannot use: {'; '.join(problems[:10])}")


def settled(labels: Sequence[dict]) -> dict[str, str]:
    """Per pair, what its labels settle: `a` or `b` (a side, named by some label and opposed by none), `tie` (only
    ties, or ties and skips), `skip` (only skips) or `conflict` (both sides named). Each annotator's latest label
    of a pair counts."""
    latest: dict[tuple[str, str, str], dict] = {}
    for label in sorted(labels, key=lambda x: str(x["labelled_at"])):
        latest[(label["pair_id"], str(label["annotator"]), label["source"])] = label
    votes: dict[str, set[str]] = {}
    for (pair, _, _), label in latest.items():
        votes.setdefault(pair, set()).add(label["label"])
    outcome = {}
    for pair, names in votes.items():
        sides = names & {"a", "b"}
        if len(sides) == 2:
            outcome[pair] = "conflict"
        elif sides:
            outcome[pair] = sides.pop()
        else:
            outcome[pair] = "tie" if "tie" in names else "skip"
    return outcome


def labelled_preferences(pairs: Sequence[dict], labels: Sequence[dict]) -> tuple[pd.DataFrame, dict[str, float]]:
    """The pairs whose labels settle a side, as preference rows in the canonical columns (source_row: the pair's line
    in the pairs file) with their provenance (pair_id, label_source, annotators, labelled_at, policy_run_id), and the
    counts of what the labels settled."""
    check_pairs(pairs)
    check_labels(labels, pairs)
    outcome = settled(labels)
    by_pair = {}
    for label in labels:
        by_pair.setdefault(label["pair_id"], []).append(label)
    rows = []
    for line, pair in enumerate(pairs, start=1):
        side = outcome.get(pair["pair_id"])
        if side not in ("a", "b"):
            continue
        own = by_pair[pair["pair_id"]]
        rows.append(
            {
                "prompt": pair["prompt"],
                "prompt_messages": pair["prompt_messages"],
                "chosen": pair[f"answer_{side}"],
                "rejected": pair["answer_b" if side == "a" else "answer_a"],
                "source_row": line,
                "pair_id": pair["pair_id"],
                "label_source": "+".join(sorted({x["source"] for x in own})),
                "annotators": sorted({str(x["annotator"]) for x in own}),
                "labelled_at": max(str(x["labelled_at"]) for x in own),
                "policy_run_id": pair["policy_run_id"],
            }
        )
    counts = {name: float(sum(v == name for v in outcome.values())) for name in ("tie", "skip", "conflict")}
    counts |= {"pairs_sent": float(len(pairs)), "labels": float(len(labels)), "labelled_pairs": float(len(rows))}
    counts["unlabelled"] = float(len({p["pair_id"] for p in pairs} - set(outcome)))
    return pd.DataFrame(rows), counts
