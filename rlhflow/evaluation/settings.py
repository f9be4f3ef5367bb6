"""How an evaluation samples, classifies and scores answers, as values (`EvaluationSettings`). The stages build them
from params.yaml once and load the models and held-out data themselves (tasks/evaluation_setup.py): nothing in the
evaluation library reads the configuration or resolves a path."""

from __future__ import annotations

from dataclasses import dataclass

from rlhflow.config.evaluate import ChampionConfig
from rlhflow.models.sampling import Sampling


@dataclass(frozen=True)
class EvaluationSettings:
    # sampling and classifying the answers
    sampling: Sampling
    precision: str  # of sampling and the KL (evaluate.precision)
    temperature: float  # of the KL's log-probabilities: the sampling temperature
    n_prompts: int | None  # per held-out split; None: one per conversation
    samples_per_prompt: int
    degenerate_repetition: float
    dev_figures: bool  # answer the dev split up front, both models (evaluate.dev_figures); else only for a champion
    # scoring
    score_batch_size: int
    perplexity_rows: int
    missing_eos_penalty: float | None  # the objective PPO optimised: the proxy minus this for an unended answer
    champion: ChampionConfig  # the champion rule's guards and level
