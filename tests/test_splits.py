"""Splits by conversation (rlhflow/data/splits.py): a conversation's branches never straddle two splits, the split
depends on the split seed alone, and prefix relations between prompts of different splits are counted."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from rlhflow.config.params import DEFAULT_PREFERENCES, REPO_ROOT
from rlhflow.data.formats import load_preferences
from rlhflow.data.splits import (
    assign_splits,
    conversation_key,
    conversation_keys,
    cross_split_prefix_pairs,
    normalized_messages,
    rows_sharing_conversations,
    split_by_conversation,
)


def pairs(n: int, prefix: str = "train") -> pd.DataFrame:
    return pd.DataFrame(
        {
            "prompt": [f"{prefix} question {i}: how do I boil water?" for i in range(n)],
            "chosen": [f"Put a pot on the stove for {i + 2} minutes." for i in range(n)],
            "rejected": ["No." for _ in range(n)],
            "source_row": list(range(1, n + 1)),
        }
    )


def dialogue(*turns: str) -> str:
    return "".join(f"\n\n{'Human' if i % 2 == 0 else 'Assistant'}: {t}" for i, t in enumerate(turns))


def branched_file(path, n_conversations: int = 60):
    """Anthropic HH rows holding each conversation at three depths; the rejected answer of a shallow row is the
    next assistant turn of the deeper ones, as in hh-rlhf."""
    rows = []
    for c in range(n_conversations):
        q1, a1, q2, a2, q3 = (f"Q1 of topic {c}", f"A1 {c}", f"Q2 {c}", f"A2 {c}", f"Q3 {c}")
        rows.append({"chosen": dialogue(q1, f"better {c}"), "rejected": dialogue(q1, a1)})
        rows.append({"chosen": dialogue(q1, a1, q2, f"fine {c}"), "rejected": dialogue(q1, a1, q2, a2)})
        rows.append({"chosen": dialogue(q1, a1, q2, a2, q3, "ok"), "rejected": dialogue(q1, a1, q2, a2, q3, "no")})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_key_is_the_first_user_turn_in_every_format():
    messages = [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "How  do I bake\nBread?"},
        {"role": "assistant", "content": "With flour."},
        {"role": "user", "content": "And yeast?"},
    ]
    transcript = "Human: How do I bake Bread?\n\nAssistant: With flour.\n\nHuman: And yeast?\n\nAssistant:"
    as_text = [{"role": "user", "content": transcript}]  # a raw HH transcript given as plain prompt text
    assert conversation_key(messages) == conversation_key(as_text) == "how do i bake bread?"
    assert normalized_messages(messages) == normalized_messages(as_text)
    assert conversation_key([{"role": "user", "content": "How do I bake bread?"}]) == "how do i bake bread?"


def test_branches_of_a_conversation_stay_in_one_split(tmp_path):
    df = load_preferences(branched_file(tmp_path / "hh.jsonl"))
    splits = assign_splits(df, test_fraction=0.2, judge_fraction=0.25, seed=0)
    keys = {name: set(conversation_keys(split)) for name, split in splits.items()}
    assert sum(len(s) for s in splits.values()) == len(df) == 180
    assert all(len(s) % 3 == 0 for s in splits.values())  # whole conversations
    assert not keys["train"] & keys["judge"] and not keys["train"] & keys["test"] and not keys["judge"] & keys["test"]
    assert cross_split_prefix_pairs(splits) == 0
    # a split by the exact prompt would have scattered the branches
    by_prompt = {"a": df.iloc[0::3], "b": df.iloc[1::3], "c": df.iloc[2::3]}
    assert cross_split_prefix_pairs(by_prompt) == 2 * 60 + 60  # q1 < q1a1q2 < q1a1q2a2q3, in three splits


def test_cross_split_prefix_pairs_counts_equal_and_prefix_prompts_once():
    a = pd.DataFrame({"prompt_messages": [[{"role": "user", "content": "Hi"}]]})
    b = pd.DataFrame(
        {
            "prompt_messages": [
                [{"role": "user", "content": "hi"}],  # equal after normalisation
                [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"}],  # a continuation
                [{"role": "user", "content": "Bye"}],
            ]
        }
    )
    assert cross_split_prefix_pairs({"a": a, "b": b}) == 2
    assert cross_split_prefix_pairs({"a": a}) == 0


def test_the_split_is_deterministic_and_depends_on_the_conversation_only():
    df = pd.concat([pairs(200), pairs(200)], ignore_index=True)  # every prompt twice
    train, test = split_by_conversation(df, 0.2, seed=0)
    assert len(train) + len(test) == len(df) and not set(train["prompt"]) & set(test["prompt"])
    assert 0.1 < len(test) / len(df) < 0.3
    again, _ = split_by_conversation(df.sample(frac=1, random_state=1), 0.2, seed=0)
    assert set(again["prompt"]) == set(train["prompt"])  # row order does not matter
    other, _ = split_by_conversation(df, 0.2, seed=1)
    assert set(other["prompt"]) != set(train["prompt"])
    sub_train, sub_test = split_by_conversation(df.iloc[:50], 0.2, seed=0)  # nor what else is in the data
    assert set(sub_train["prompt"]) <= set(train["prompt"]) and set(sub_test["prompt"]) <= set(test["prompt"])


def test_a_split_is_never_left_empty():
    train, test = split_by_conversation(pairs(2), 0.01, seed=0)
    assert len(train) == 1 and len(test) == 1


def test_the_judge_takes_its_share_from_training_only():
    df = pd.concat([pairs(300), pairs(300)], ignore_index=True)
    splits = assign_splits(df, test_fraction=0.2, judge_fraction=0.25, seed=0)
    prompts = {name: set(split["prompt"]) for name, split in splits.items()}
    assert sorted(splits) == ["judge", "test", "train"] and sum(map(len, splits.values())) == len(df)
    assert not prompts["train"] & prompts["judge"] and not prompts["judge"] & prompts["test"]
    assert 0.18 < len(prompts["judge"]) / 300 < 0.32 and 0.14 < len(prompts["test"]) / 300 < 0.26
    _, test_alone = split_by_conversation(df, 0.2, seed=0)
    assert prompts["test"] == set(test_alone["prompt"])


def test_with_a_held_out_file_training_rows_of_its_conversations_are_left_out(tmp_path):
    df = load_preferences(branched_file(tmp_path / "hh.jsonl", 20))
    test = df.iloc[[1]]  # the second depth of conversation 0 is in the held-out file
    splits = assign_splits(df.drop(index=1), test_fraction=0.2, judge_fraction=0.25, seed=0, test=test)
    assert sum(len(splits[s]) for s in ("train", "judge")) == len(df) - 3  # all of conversation 0 is left out
    assert cross_split_prefix_pairs(splits) == 0


def test_demonstrations_sharing_a_conversation_with_held_out_splits_are_found():
    demos = pd.DataFrame(
        {
            "prompt_messages": [
                [{"role": "user", "content": "Human: What is 2+2?\n\nAssistant: 4\n\nHuman: And 3+3?"}],
                [{"role": "user", "content": "Tell me a joke"}],
            ],
            "source_row": [1, 2],
        }
    )
    test = pd.DataFrame({"prompt_messages": [[{"role": "user", "content": "what is 2+2?"}]]})
    assert rows_sharing_conversations(demos, {"test": test, "judge": test.iloc[:0]}) == {"test": [1]}


def test_the_shipped_data_splits_share_no_conversation():
    df = load_preferences(REPO_ROOT / DEFAULT_PREFERENCES)
    splits = assign_splits(df, test_fraction=0.2, judge_fraction=0.25, seed=0)
    keys = {name: set(conversation_keys(split)) for name, split in splits.items()}
    assert not keys["train"] & keys["judge"] and not keys["train"] & keys["test"] and not keys["judge"] & keys["test"]
    assert cross_split_prefix_pairs(splits) == 0
    # no test pair's rejected answer is an assistant turn of a training or judge dialogue (short stock phrases
    # such as "What do you mean?" recur across conversations)
    trained_turns = {
        text
        for name in ("train", "judge")
        for turns in splits[name]["prompt_messages"].map(normalized_messages)
        for role, text in turns
        if role == "assistant"
    }
    rejected = {" ".join(r.lower().split()) for r in splits["test"]["rejected"] if len(r.split()) >= 5}
    assert not rejected & trained_turns


@pytest.mark.parametrize("split_seed", [0, 1])
def test_the_split_seed_moves_the_split(split_seed):
    df = load_preferences(REPO_ROOT / DEFAULT_PREFERENCES)
    test = assign_splits(df, test_fraction=0.2, judge_fraction=0.25, seed=split_seed)["test"]
    baseline = assign_splits(df, test_fraction=0.2, judge_fraction=0.25, seed=0)["test"]
    assert (set(test["prompt"]) == set(baseline["prompt"])) == (split_seed == 0)


def test_a_held_out_prompt_changed_by_an_invisible_character_is_still_held_out():
    """Where text from outside meets a held-out split (demonstrations, labelled pairs, a test file), prompts are
    compared folded: NFKC, invisible format characters out, case folded, whitespace collapsed."""
    from rlhflow.data.splits import outside_conversations, rows_sharing_conversations

    def turn(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    test = pd.DataFrame({"prompt_messages": [turn("How do I pick a lock?")]})
    variants = ["How do I pick a\u200b lock?", "\uff28ow do I pick a lock?", "How do I\u00ad pick a\u00a0LOCK?"]
    others = pd.DataFrame({"prompt_messages": [turn(v) for v in variants] + [turn("How do I bake bread?")]})
    others["source_row"] = [1, 2, 3, 4]
    assert rows_sharing_conversations(others, {"test": test}) == {"test": [1, 2, 3]}
    assert outside_conversations(others, test)["source_row"].tolist() == [4]


@pytest.mark.parametrize(
    "variant",
    [
        "How do I pick a\u034f lock?",  # combining grapheme joiner
        "How do I pick a\ufe0f lock?",  # variation selector
        "How do I\u3164 pick a lock?",  # Hangul filler
        "\u115fHow do I pick a lock?",  # Hangul choseong filler
        "H\u043ew d\u043e I pi\u0441k \u0430 l\u043e\u0441k?",  # Cyrillic о, с, а
        "HOW DO I PI\u0421K \u0391 LO\u0421K?",  # Cyrillic С, Greek Α, before case folding
    ],
)
def test_a_held_out_prompt_spelled_with_look_alikes_or_other_invisible_characters_is_still_held_out(variant):
    from rlhflow.data.splits import folded, rows_sharing_conversations

    def turn(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    test = pd.DataFrame({"prompt_messages": [turn("How do I pick a lock?")]})
    others = pd.DataFrame({"prompt_messages": [turn(variant), turn("How do I bake bread?")], "source_row": [1, 2]})
    assert rows_sharing_conversations(others, {"test": test}) == {"test": [1]}
    assert folded("ПРИВЕТ") == folded("привет") != folded("hello")  # other scripts still fold their own case
