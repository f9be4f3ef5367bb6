"""What an evaluation reads, as values (`EvaluationSetup`): where the models and the held-out data are, and how
answers are sampled, classified and scored. The stages build it from params.yaml once
(tasks/evaluation_setup.py); nothing in the evaluation library reads the configuration or resolves a path from it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlhflow.config.evaluate import ChampionConfig
from rlhflow.config.params import JudgeConfig
from rlhflow.models.sampling import Sampling


@dataclass(frozen=True)
class EvaluationSetup:
    # the models
    sft_dir: Path
    policy_dir: Path
    reward_model_dir: Path  # the proxy
    judge: JudgeConfig  # the judge section: its kind, endpoint and template (rlhflow.evaluation.judges.load_judge)
    judge_dir: Path  # where the judge stage wrote a trained judge
    device: str  # the device setting (rlhflow.models.loading.pick_device)
    # the data: validated_dir/test.jsonl and, where validate wrote one, dev.jsonl; the sft_answers stage's output
    validated_dir: Path
    reference_dir: Path
    # sampling and classifying the answers
    sampling: Sampling
    precision: str  # of sampling and the KL (evaluate.precision)
    temperature: float  # of the KL's log-probabilities: the sampling temperature
    n_prompts: int | None  # per held-out split; None: one per conversation
    samples_per_prompt: int
    degenerate_repetition: float
    # scoring
    score_batch_size: int
    reward_model_batch_size: int
    judge_batch_size: int
    perplexity_rows: int
    missing_eos_penalty: float | None  # the objective PPO optimised: the proxy minus this for an unended answer
    champion: ChampionConfig  # the champion rule's guards and level
    # where the stage's outputs go
    report_dir: Path
    metrics_dir: Path
