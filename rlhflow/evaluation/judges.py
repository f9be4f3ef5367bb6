"""Judges: the evaluation's independent instrument, which says which of two answers to a prompt is better.

`judge.kind` picks one (`load_judge`): `trained` (the judge stage's reward model), `reward_model` (any one-label
sequence-classification reward model, read as a trained one is) or `llm` (a chat model behind an OpenAI-compatible
endpoint, asked in both answer orders: rlhflow/evaluation/judging.py, with what every judge shares and the settings
check, none of which loads torch). Pointwise judges score answers one at a time; the llm judge only compares. The
whole contract: docs/evaluation.md, The judge.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
from scipy.special import expit
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlhflow.config.params import JudgeConfig
from rlhflow.data.sources import resolve_model, resolve_source
from rlhflow.evaluation.judging import (
    Judge,
    JudgeUnavailableError,
    LLMJudge,
    Messages,
    Verdicts,
    check_lengths,
    check_reward_model,
)
from rlhflow.evaluation.pairs import accuracy_standard_error, evaluate_pairs, length_aware_pair_metrics
from rlhflow.fsutil import dir_md5
from rlhflow.models.loading import disable_dropout
from rlhflow.training.reward_model import NORM_FILE, RewardModel, apply_pooling, prepare_reward_tokenizer

JUDGE_FILE = "judge.json"  # what the judge stage writes for a judge it did not train


# ---- pointwise judges: a reward model -------------------------------------------------------------------------


class PointwiseJudge(Judge):
    """A reward model as a judge (trained, reward_model)."""

    pointwise = True

    def __init__(self, reward_model: RewardModel, *, kind: str, model: str, basis: str):
        self.reward_model, self.kind, self.model, self._basis = reward_model, kind, model, basis

    def score(self, prompt_messages: list[Messages], responses: list[str]) -> np.ndarray:
        return self.reward_model.score(prompt_messages, responses).double().numpy()

    def compare(self, prompt_messages: list[Messages], answers_a: list[str], answers_b: list[str]) -> Verdicts:
        check_lengths(prompt_messages, answers_a, answers_b)
        return verdicts_from_scores(self.score(prompt_messages, answers_a), self.score(prompt_messages, answers_b))

    def describe(self) -> dict[str, str]:
        return {"judge/kind": self.kind, "judge/model": self.model}

    def basis_md5(self) -> str:
        return self._basis


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return expit(np.asarray(x, dtype=float))


def verdicts_from_scores(a_scores, b_scores) -> Verdicts:
    """A pointwise scorer's verdict on each pair (a, b): the higher score wins (a tie is half), and the soft
    preference for a is sigmoid(score_a - score_b), the Bradley-Terry probability that a is preferred."""
    a, b = np.asarray(a_scores, dtype=float), np.asarray(b_scores, dtype=float)
    return Verdicts(wins=(a > b) + 0.5 * (a == b), preference=_sigmoid(a - b), soft=True)


def load_reward_model_judge(spec: str, *, max_length: int, batch_size: int, device) -> PointwiseJudge:
    """A Hugging Face one-label sequence classifier as a judge. A reward model this project trained (its dir holds
    reward_normalization.json) keeps its normalisation and max_length; any other gives raw scores, read at most
    `max_length` tokens (and no more than its position embeddings)."""

    check_reward_model(spec)
    source = resolve_source(spec)
    local = source.kind in ("dir", "package")
    location = Path(resolve_model(spec).location) if local else None
    basis = dir_md5(location) if local else hashlib.md5(f"hub:{spec}".encode()).hexdigest()
    if local and (location / NORM_FILE).is_file():
        rm = RewardModel.load(location, batch_size=batch_size, device=device)
        return PointwiseJudge(rm, kind="reward_model", model=spec, basis=basis)
    where = str(location) if local else spec
    tok = prepare_reward_tokenizer(AutoTokenizer.from_pretrained(where))
    model = AutoModelForSequenceClassification.from_pretrained(where, use_safetensors=True)
    if model.config.num_labels != 1:
        raise JudgeUnavailableError(f"judge.model={spec} has {model.config.num_labels} labels; a reward model has 1")
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id  # decoders read the score at the last non-pad token
    model = disable_dropout(apply_pooling(model, getattr(model.config, "reward_pooling", "model")))
    positions = getattr(model.config, "max_position_embeddings", None) or max_length
    rm = RewardModel(model, tok, max_length=min(max_length, positions), batch_size=batch_size, device=device)
    return PointwiseJudge(rm, kind="reward_model", model=spec, basis=basis)


# ---- choosing and measuring -----------------------------------------------------------------------------------


def load_judge(settings: JudgeConfig, judge_dir: str | os.PathLike, *, batch_size: int, device) -> Judge:
    """The judge `settings.kind` names. `judge_dir`: where the judge stage wrote the trained judge (read only for
    kind=trained)."""
    if settings.kind == "trained":
        judge_dir = Path(judge_dir)
        rm = RewardModel.load(judge_dir, batch_size=batch_size, device=device)
        return PointwiseJudge(rm, kind="trained", model=str(judge_dir), basis=dir_md5(judge_dir))
    if settings.kind == "reward_model":
        return load_reward_model_judge(
            settings.model, max_length=settings.max_length, batch_size=batch_size, device=device
        )
    return LLMJudge(settings)


def pair_metrics(judge: Judge, rows: list[dict]) -> tuple[dict[str, float], Verdicts]:
    """The judge on preference pairs (chosen as a, rejected as b), measured as the trained judge is
    (rlhflow.evaluation.pairs.evaluate_pairs): `accuracy` (ties and split verdicts count half), `accuracy_se`, the
    length rule beside it with intervals (LENGTH_AWARE_METRICS) and `pairs`; a pointwise judge adds its score
    margins, the llm judge `malformed_replies`."""

    prompts = [r["prompt_messages"] for r in rows]
    chosen, rejected = [r["chosen"] for r in rows], [r["rejected"] for r in rows]
    if isinstance(judge, PointwiseJudge):
        pairs = evaluate_pairs(judge.reward_model, rows)
        wins = pairs.correct.double().numpy()
        rm = judge.reward_model
        preference = _sigmoid((rm.normalise(pairs.chosen) - rm.normalise(pairs.rejected)).double().numpy())
        return pairs.metrics, Verdicts(wins=wins, preference=preference, soft=True)
    verdicts = judge.compare(prompts, chosen, rejected)
    accuracy = float(verdicts.wins.mean()) if len(rows) else float("nan")
    metrics: dict[str, Any] = {
        "accuracy": accuracy,
        "accuracy_se": accuracy_standard_error(accuracy, len(rows)),
        **length_aware_pair_metrics(verdicts.wins.tolist(), rows),
        "pairs": float(len(rows)),
        "malformed_replies": float(verdicts.malformed),
    }
    return metrics, verdicts
