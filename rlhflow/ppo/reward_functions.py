"""Rule-based rewards for PPO without a reward model: `--set ppo.reward_fn=rlhflow.ppo.reward_functions:contains_word
--set ppo.reward_fn_kwargs='{word: thanks}'`.

A reward function takes the batch of prompts (chat messages) and the decoded responses, plus the keyword
arguments in `ppo.reward_fn_kwargs`, and returns one float per response. Your own lives in any importable
module and is named the same way (`package.module:function`).
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable, Sequence


def load_reward_fn(spec: str, kwargs: dict | None = None) -> Callable:
    """`package.module:function`, called as fn(prompt_messages_batch, responses, **kwargs) -> sequence of floats."""
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"ppo.reward_fn {spec!r} must look like 'package.module:function'")
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise ValueError(f"ppo.reward_fn {spec!r}: {attr!r} is not a callable in {module_name}")
    return functools.partial(fn, **(kwargs or {}))


def contains_word(prompts: Sequence, responses: Sequence[str], word: str = "thanks") -> list[float]:
    """1 when the response contains `word` as a whole word (any case), else 0: the "say a given word" task."""
    pattern = re.compile(rf"\b{re.escape(word)}\b", re.IGNORECASE)
    return [1.0 if pattern.search(text) else 0.0 for text in responses]


def target_length(prompts: Sequence, responses: Sequence[str], words: int = 20) -> list[float]:
    """Minus the relative distance of the response's word count from `words`: 0 at the target, -1 at
    zero words or twice the target."""
    return [-abs(len(text.split()) - words) / words for text in responses]


def vowel_fraction(prompts: Sequence, responses: Sequence[str]) -> list[float]:
    """The share of characters that are vowels: a dense signal that tiny models learn within a few updates."""
    return [sum(ch in "aeiouAEIOU" for ch in text) / max(len(text), 1) for text in responses]
