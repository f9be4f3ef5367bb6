"""Evaluation answers: ended, cut at the limit or degenerate (rlhflow/evaluation/answers.py)."""

from __future__ import annotations

import pytest
import torch

from rlhflow.evaluation.answers import MIN_TOKENS, Answers, classify, ended_within, repeated_ngram_share
from rlhflow.models.generation import GenerationOutput


def test_repeated_ngram_share_of_a_loop_a_plain_answer_and_an_emoji_run():
    loop = [5, 6, 7, 8, 9, 10] * 8  # "You can buy it right here." again and again
    assert repeated_ngram_share(loop) == pytest.approx(1 - 6 / 45)
    assert repeated_ngram_share(list(range(40))) == 0.0
    assert repeated_ngram_share([42] * 30) == pytest.approx(1 - 1 / 27)  # one token repeated: one distinct 4-gram
    assert repeated_ngram_share([1, 2, 3]) == 0.0  # no 4-gram at all


@pytest.mark.parametrize(
    "ended,tokens,expected",
    [
        (True, list(range(30)), "ended"),
        (False, list(range(30)), "cut"),
        (False, [5, 6, 7, 8] * 10, "degenerate"),
        (True, [5, 6, 7, 8] * 10, "degenerate"),  # a loop that ends is still a loop
        (True, [7] * (MIN_TOKENS - 1), "ended"),  # too short to judge repetition
    ],
)
def test_classify(ended, tokens, expected):
    assert classify(ended, tokens, threshold=0.5) == expected


def test_threshold_separates_a_half_repeated_answer():
    half = list(range(24)) + list(range(24))  # its second half repeats the first: 21 of 45 4-grams are copies
    share = repeated_ngram_share(half)
    assert 0.4 < share < 0.5
    assert classify(True, half, threshold=0.5) == "ended" and classify(True, half, threshold=0.4) == "degenerate"


def test_answers_from_generation_outputs_read_only_the_real_tokens():
    pad = 0
    loop = [5, 6, 7, 8] * 5
    response = torch.tensor([[11, 12, 13, 2, pad] + [pad] * 15, loop])
    mask = torch.tensor([[1, 1, 1, 1, 0] + [0] * 15, [1] * 20])
    out = GenerationOutput(
        query_response=torch.cat([torch.ones(2, 3, dtype=torch.long), response], 1),
        response=response,
        response_mask=mask,
        ended=torch.tensor([True, False]),
        texts=["a b c", "loop"],
    )
    answers = Answers.from_outputs([out], threshold=0.5)
    assert answers.tokens == [4, 20] and answers.ended == [True, False]
    assert answers.classes == ["ended", "degenerate"]
    assert answers.shares() == {"ended": 0.5, "cut": 0.0, "degenerate": 0.5}
    assert Answers.from_json(answers.to_json()) == answers


def test_ended_within_a_limit():
    tokens, ended = [10, 50, 200, 512], [True, True, True, False]
    assert ended_within(tokens, ended, 48) == 0.25
    assert ended_within(tokens, ended, 256) == 0.75
    assert ended_within(tokens, ended, 512) == 0.75
