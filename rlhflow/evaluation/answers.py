"""Evaluation answers: what each model said on the held-out prompts, and whether each answer ended, was cut at the
limit or is degenerate (docs/evaluation.md#ended-cut-degenerate).

- `degenerate`: a repetition loop; at least `MIN_TOKENS` tokens, and its share of repeated token 4-grams reaches
  `evaluate.degenerate_repetition` (0.5: half of its 4-grams are copies). A loop that ends is still degenerate;
- `ended`: EOS or a stop string within the limit, not degenerate;
- `cut`: ran into `max_new_tokens` without ending, not degenerate.
Token 4-grams, not word 4-grams: a run of one emoji or of punctuation has no spaces but repeats its tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

CLASSES = ("ended", "cut", "degenerate")
NGRAM = 4
MIN_TOKENS = 16


def repeated_ngram_share(token_ids: Sequence[int], n: int = NGRAM) -> float:
    """Share of the answer's n-grams that already occurred earlier in it: 0 for an answer without repeats, close to 1
    for a loop. (count - distinct) / count over the answer's n-grams; 0 when it has none."""
    grams = [tuple(token_ids[i : i + n]) for i in range(len(token_ids) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(Counter(grams)) / len(grams)


def classify(ended: bool, token_ids: Sequence[int], threshold: float) -> str:
    """`ended`, `cut` or `degenerate` (module docstring)."""
    if len(token_ids) >= MIN_TOKENS and repeated_ngram_share(token_ids) >= threshold:
        return "degenerate"
    return "ended" if ended else "cut"


@dataclass
class Answers:
    """One model's answers to the evaluation prompts, one row per (prompt, sample), in prompt order."""

    texts: list[str]
    ended: list[bool]  # emitted EOS or a stop string within the limit
    tokens: list[int]  # answer length in tokens (EOS included)
    repetition: list[float]  # repeated 4-gram share
    classes: list[str]  # ended / cut / degenerate
    extra: dict[str, list[float]] = field(default_factory=dict)  # per answer: scores of the proxy and the judge

    @classmethod
    def from_outputs(cls, outputs, threshold: float) -> Answers:
        """From `rlhflow.models.generation.GenerationOutput`s (their real response tokens: `response_mask`)."""
        texts, ended, tokens, repetition, classes = [], [], [], [], []
        for out in outputs:
            for row, mask, end, text in zip(out.response.tolist(), out.response_mask.tolist(), out.ended, out.texts):
                ids = [t for t, m in zip(row, mask) if m]
                texts.append(text)
                ended.append(bool(end))
                tokens.append(len(ids))
                repetition.append(repeated_ngram_share(ids))
                classes.append(classify(bool(end), ids, threshold))
        return cls(texts, ended, tokens, repetition, classes)

    def __len__(self) -> int:
        return len(self.texts)

    def is_class(self, name: str) -> np.ndarray:
        return np.array([c == name for c in self.classes], dtype=bool)

    def shares(self) -> dict[str, float]:
        """Share of each class among the answers."""
        n = max(len(self), 1)
        return {name: sum(c == name for c in self.classes) / n for name in CLASSES}

    def split(self, sizes: dict[str, int]) -> dict[str, Answers]:
        """Consecutive parts of these answers: the first sizes[first] rows, then the next sizes[second], ..."""
        parts, start = {}, 0
        for name, size in sizes.items():
            cut = slice(start, start + size)
            parts[name] = Answers(
                self.texts[cut],
                self.ended[cut],
                self.tokens[cut],
                self.repetition[cut],
                self.classes[cut],
                {k: v[cut] for k, v in self.extra.items()},
            )
            start += size
        if start != len(self):
            raise ValueError(f"parts of {start} rows for {len(self)} answers")
        return parts

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Answers:
        return cls(**data)


def ended_within(tokens: Sequence[int], ended: Sequence[bool], limit: int) -> float:
    """Share of answers that ended by themselves within `limit` new tokens (answers sampled with a larger limit)."""
    return float(np.mean([e and t <= limit for t, e in zip(tokens, ended)])) if len(tokens) else float("nan")
