"""Train / judge / dev / test splits by conversation.

hh-rlhf holds one conversation at several depths, and the rejected answer of one row is often the next turn of
another, so splitting by prompt text would leak the test set into training. Every row is keyed by its conversation
(`conversation_key`: the normalised first user turn, which a prompt and its message-prefixes share), and a
conversation's rows go to one split, chosen by a hash of the key and `validate.split_seed` (not the training seed:
a seed sweep keeps the test set and the judge). `cross_split_prefix_pairs` counts prompt pairs in different splits
where one is a message-prefix of the other, independently of the keys (0 by construction).
See docs/data.md#splits-train-judge-dev-test.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterable, Sequence

import pandas as pd

from rlhflow.data.converters import parse_hh_dialogue

Messages = list[dict[str, str]]
_HH_MARKER = re.compile(r"(^|\n\n)(Human|Assistant):")


def normalized_messages(prompt_messages: Messages) -> tuple[tuple[str, str], ...]:
    """The conversation as (role, text) turns, as every input format gives it: an Anthropic-style transcript
    passed as one user message ("Human: ...\\n\\nAssistant: ...") is split into its turns, system messages are
    left out, and text is lower-cased with whitespace collapsed."""
    messages = list(prompt_messages or [])
    if len(messages) == 1 and messages[0].get("role") == "user" and _HH_MARKER.search(messages[0]["content"]):
        messages = parse_hh_dialogue(messages[0]["content"])
    return tuple(
        (m["role"], " ".join(str(m.get("content", "")).lower().split())) for m in messages if m.get("role") != "system"
    )


def conversation_key(prompt_messages: Messages) -> str:
    """What keeps a conversation's branches together: its first user turn, normalised."""
    turns = normalized_messages(prompt_messages)
    first_user = next((text for role, text in turns if role == "user"), None)
    return first_user if first_user is not None else (turns[0][1] if turns else "")


def conversation_keys(df: pd.DataFrame) -> pd.Series:
    """`conversation_key` per row, from `prompt_messages` (or, in a frame without them, the prompt text)."""
    return _messages(df).map(conversation_key).astype(object)


# Drawn as nothing, yet no format (Cf) character: the rest of Unicode's Default_Ignorable_Code_Point (combining
# grapheme joiner, Hangul fillers, Mongolian and other variation selectors, tag characters...) and the braille blank
_INVISIBLE = re.compile(
    "[\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180f\u2800\u3164\ufe00-\ufe0f\uffa0\ufff0-\ufff8"
    "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e0fff]"
)
# Cyrillic and Greek letters drawn as a Latin one, after case folding (so "А", "а" and "a" meet); one Latin letter
# each, from the capital where the two cases look like different Latin letters (Greek "Ν"/"ν": "n")
_LATIN_LOOKALIKES = str.maketrans(
    "авсԁеһіјкӏмнорԛѕтуүхԝαβεζηικμνορτυχıɑɡ",
    "abcdehijklmhopqstyyxwabezhikmnoptyxiag",
)


def folded(text: str) -> str:
    """`text` as the held-out checks compare it: Unicode NFKC (full-width letters, ligatures and compatibility forms
    as their plain letters), invisible characters (zero-width spaces and joiners, soft hyphens, byte-order and
    direction marks, variation selectors, fillers, tags) removed, case folded, common Cyrillic and Greek look-alikes
    of Latin letters as those letters, whitespace collapsed."""
    text = _INVISIBLE.sub("", unicodedata.normalize("NFKC", text))
    text = "".join(c for c in text if unicodedata.category(c) != "Cf").casefold().translate(_LATIN_LOOKALIKES)
    return " ".join(text.split())


def held_out_keys(df: pd.DataFrame) -> pd.Series:
    """`conversation_key` per row, `folded`: what a held-out check compares where text from outside meets a
    held-out split (a test file, demonstrations, labelled pairs), so that a prompt changed by one invisible
    character is still the held-out one. The split itself hashes `conversation_keys`: the shipped splits stay as
    they are."""
    return conversation_keys(df).map(folded).astype(object)


def _messages(df: pd.DataFrame) -> pd.Series:
    """Each row's prompt as messages: `prompt_messages`, or in a frame without them the prompt text as one turn."""
    if "prompt_messages" in df.columns:
        return df["prompt_messages"].map(lambda m: m if isinstance(m, list) else [])
    return df["prompt"].map(lambda p: [{"role": "user", "content": p}] if isinstance(p, str) else [])


def _key_hash(key: str, seed: int) -> float:
    """A number in [0, 1) that depends only on the conversation key and the split seed (stable across runs)."""
    digest = hashlib.sha256(f"{seed}\x00{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_by_conversation(df: pd.DataFrame, test_fraction: float, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Split pairs by conversation: all rows of a conversation go to one side, decided by a hash of its key."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    keys = conversation_keys(df)
    hashes = {k: _key_hash(k, seed) for k in keys.unique()}
    held_out = {k for k, h in hashes.items() if h < test_fraction}
    # With very few conversations the threshold can leave a side empty; move the closest conversation over.
    if len(hashes) >= 2 and not held_out:
        held_out = {min(hashes, key=hashes.get)}
    elif len(hashes) >= 2 and len(held_out) == len(hashes):
        held_out.discard(max(hashes, key=hashes.get))
    in_held_out = keys.isin(held_out).to_numpy(dtype=bool)
    return df[~in_held_out].reset_index(drop=True), df[in_held_out].reset_index(drop=True)


def assign_splits(
    df: pd.DataFrame,
    *,
    test_fraction: float,
    judge_fraction: float,
    seed: int,
    dev_fraction: float = 0.0,
    feedback_fraction: float = 0.0,
    test: pd.DataFrame | None = None,
) -> dict[str, pd.DataFrame]:
    """train / judge / dev / test splits by conversation. The held-out conversations (a share test_fraction +
    dev_fraction) are cut from the rest by one hash and divided into dev (for choosing: champion decisions, a
    sweep's best point) and test (for the report only) by a second; the judge's share is split off the training
    conversations by a third, so the judge reward model never sees a conversation the proxy or PPO trains on. With
    dev_fraction 0 there is no dev split. The feedback split (feedback_fraction > 0: prompts whose answers people
    label, docs/feedback.md) is cut from the training conversations by a fourth hash. With `test` given (a held-out
    file), `df` is split into train, judge and dev only, each fraction a share of `df`, and rows of `df` in a
    conversation the test file holds are left out (see `outside_conversations`)."""
    if test is None:
        train, held_out = split_by_conversation(df, test_fraction + dev_fraction, seed)
        if dev_fraction > 0:
            test, dev = split_by_conversation(held_out, dev_fraction / (test_fraction + dev_fraction), seed + 2)
        else:
            test, dev = held_out, None
        rest = 1 - test_fraction - dev_fraction  # the training conversations' share of df
    else:
        train, dev, rest = outside_conversations(df, test), None, 1.0
        if dev_fraction > 0:
            train, dev = split_by_conversation(train, dev_fraction, seed + 2)
            rest -= dev_fraction
    splits = {"train": train}
    if judge_fraction > 0:
        splits["train"], splits["judge"] = split_by_conversation(train, judge_fraction / rest, seed + 1)
    if feedback_fraction > 0:
        train_share = rest - judge_fraction if judge_fraction > 0 else rest
        splits["train"], splits["feedback"] = split_by_conversation(
            splits["train"], feedback_fraction / train_share, seed + 3
        )
    if dev is not None:
        splits["dev"] = dev
    splits["test"] = test
    return splits


def outside_conversations(df: pd.DataFrame, held_out: pd.DataFrame) -> pd.DataFrame:
    """The rows of `df` whose conversation is not in `held_out`."""
    if not len(df) or not len(held_out):
        return df.reset_index(drop=True)
    return df[~held_out_keys(df).isin(set(held_out_keys(held_out)))].reset_index(drop=True)


def rows_sharing_conversations(df: pd.DataFrame, others: dict[str, pd.DataFrame]) -> dict[str, list[int]]:
    """Per frame in `others`: the `source_row`s of `df` whose conversation is one of its conversations (e.g.
    demonstrations that share a conversation with the test or judge split)."""
    keys = held_out_keys(df)
    found = {}
    for name, other in others.items():
        if not len(other):
            continue
        rows = df.loc[keys.isin(set(held_out_keys(other))).to_numpy(dtype=bool), "source_row"].tolist()
        if rows:
            found[name] = rows
    return found


def _prefixes(turns: Sequence) -> Iterable[tuple]:
    return (tuple(turns[:i]) for i in range(1, len(turns) + 1))


def cross_split_prefix_pairs(splits: dict[str, pd.DataFrame]) -> int:
    """Pairs of distinct prompts in different splits where one prompt's turns are a prefix of the other's (equal
    prompts included): what branch-aware splitting rules out."""
    prompts = {split: set(_messages(df).map(normalized_messages)) for split, df in splits.items()}
    # every prefix of every prompt, with the splits it occurs in
    prefix_splits: dict[tuple, dict[str, int]] = {}
    for split, turn_sets in prompts.items():
        for turns in turn_sets:
            for prefix in _prefixes(turns):
                counts = prefix_splits.setdefault(prefix, {})
                counts[split] = counts.get(split, 0) + 1
    pairs = 0
    for split, turn_sets in prompts.items():
        for turns in turn_sets:  # turns is a prefix of how many prompts of other splits?
            pairs += sum(n for other, n in prefix_splits.get(turns, {}).items() if other != split)
    # an equal prompt in two splits was counted from both sides
    equal = sum(1 for i, a in enumerate(prompts) for b in list(prompts)[i + 1 :] for _ in prompts[a] & prompts[b])
    return pairs - equal
