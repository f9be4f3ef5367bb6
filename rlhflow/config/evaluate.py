"""The evaluate section of params.yaml (rlhflow/config/params.py holds the rest): which prompts, how both models sample
their answers, when an answer is degenerate, and the champion rule's setting (docs/evaluation.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhflow.config.section import Section


class ChampionConfig(Section):
    """The champion rule's level and guards (rlhflow/evaluation/champion.py, docs/mlflow.md)."""

    alpha: float = Field(
        0.05,
        gt=0,
        lt=1,
        description="the chance, over every challenge to come, that a challenger no better than its champion is "
        "ever promoted; version k is tested at alpha * 6 / (pi^2 k^2)",
    )
    kl_budget: float | None = Field(
        None,
        gt=0,
        description="the most KL to the SFT model (nats, on the dev prompts) a champion may have; unset: none",
    )
    min_ended: float | None = Field(
        0.5, ge=0, le=1, description="the least share of ended answers on the dev prompts a champion may have"
    )
    max_length_ratio: float | None = Field(
        2.0,
        ge=1,
        description="a challenger whose mean answer length is more than this many times the champion's, or less "
        "than its inverse, is not promoted; unset: no bound",
    )


class EvaluateConfig(Section):
    n_prompts: int | None = Field(
        None,
        ge=1,
        description="held-out prompts answered by the SFT model and the policy, one per test conversation; unset: "
        "every test conversation",
    )
    samples_per_prompt: int = Field(1, ge=1, description="answers sampled per prompt and model")
    seed: int = Field(
        0,
        ge=0,
        description="the evaluation's sampling seed: both models compared sample on the same random streams; the "
        "top-level `seed` does not move it, so a training-seed sweep is evaluated on the same streams",
    )
    max_new_tokens: int = Field(256, ge=1, description="answer limit (docs/evaluation.md: how it was chosen)")
    top_p: float | None = Field(
        None, gt=0, le=1, description="nucleus sampling of the evaluation answers; unset: ppo.top_p"
    )
    repetition_penalty: float = Field(
        1.0, gt=0, description="CTRL-style repetition penalty of the evaluation answers (1: none)"
    )
    degenerate_repetition: float = Field(
        0.5,
        gt=0,
        le=1,
        description="an answer whose share of repeated token 4-grams reaches this is degenerate (a repetition loop)",
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="bf16 weights for sampling and scoring, log-probs in fp32; auto: bf16 where the device runs it "
        "natively, else fp32",
    )
    temperature: float | None = Field(
        None,
        gt=0,
        description="sampling temperature of the evaluation samples and of the KL computed on them; "
        "unset: ppo.temperature, the temperature the policy was trained at (top-k / top-p are ppo's too)",
    )
    batch_size: int = Field(
        144,
        ge=1,
        description="answers sampled per batch (ended answers leave it); nearly every batch holds an answer that runs "
        "to the limit, so fewer, larger batches finish sooner (128 vs 48 on 128 prompts, 2 CPU cores: 1.22x the "
        "SFT model's tokens per second, 1.37x the policy's); 144 answers the test split in one batch, both held-out "
        "splits in two",
    )
    score_batch_size: int = Field(
        16,
        ge=1,
        description="rows per forward pass when scoring token by token (KL to the SFT model, perplexity); rows are "
        "batched by length, and each holds full-vocabulary logits for every position",
    )
    perplexity_rows: int = Field(64, ge=1)
    dev_figures: bool = Field(
        False,
        description="also answer the dev prompts with both models up front and log the policy against the SFT model "
        "there (dev/...: what a sweep chooses its best point by; a sweep sets it); unset, the dev split is answered "
        "only when the champion rule compares the policy with a champion, by the policy and the champion alone",
    )
    reference_dir: str = Field(
        "data/sft_answers",
        description="the SFT model's evaluation answers and their scores (the sft_answers stage), reused by every "
        "evaluate of a policy against the same SFT model, prompts and sampling settings",
    )
    promote: Literal["auto", "force", "never"] = Field(
        "auto",
        description="champion rule (docs/mlflow.md): auto promotes a challenger that passes the guards and beats a "
        "champion of the same splits and judge head to head on the dev split (`champion`); force promotes it "
        "whatever the comparison; never moves no alias",
    )
    champion: ChampionConfig = ChampionConfig()
    report_dir: str = "reports/evaluate"
