"""The policy-optimisation settings: params.yaml's `align` section (AlignConfig), which algorithm the ppo stage runs
(ALGORITHMS) and the settings of trl's GRPO, RLOO and DPO trainers. The project's own PPO engine is configured by the
`ppo` section (rlhflow/config/params.py), whose sampling settings, reward source and output paths every algorithm
shares.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhflow.config.section import Section

ALGORITHMS = ("ppo", "grpo", "rloo", "dpo")
# the values trl 1.16's GRPOConfig.loss_type, GRPOConfig.scale_rewards and DPOConfig.loss_type accept
GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
GRPO_SCALE_REWARDS = ("group", "batch", "none")
DPO_LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)


class GRPOSettings(Section):
    """trl's GRPOTrainer: group-relative advantages over num_generations completions of each prompt."""

    num_generations: int = Field(
        4, ge=2, description="completions sampled per prompt; each one's advantage is its reward against its group's"
    )
    beta: float = Field(
        0.04, ge=0, description="KL coefficient towards the SFT model (0: no reference model is loaded, no KL)"
    )
    loss_type: Literal[GRPO_LOSS_TYPES] = Field(
        "dapo",
        description="how token losses are aggregated (trl's GRPOConfig.loss_type); luspo switches trl to "
        "sequence-level importance ratios, as its paper does",
    )
    scale_rewards: Literal[GRPO_SCALE_REWARDS] = Field(
        "group",
        description="rewards minus their group mean, divided by the std of the group, of the whole batch, or none",
    )
    epsilon: float = Field(0.2, gt=0, lt=1, description="clip range of the importance ratio")


class RLOOSettings(Section):
    """trl's RLOOTrainer: REINFORCE with the mean reward of the other completions of the same prompt as baseline."""

    num_generations: int = Field(
        4, ge=2, description="completions sampled per prompt; each one's baseline is the mean of the others'"
    )
    beta: float = Field(
        0.05, ge=0, description="KL coefficient towards the SFT model (0: no reference model is loaded, no KL)"
    )


class DPOSettings(Section):
    """trl's DPOTrainer on the train split's preference pairs, the SFT model as the reference."""

    beta: float = Field(0.1, gt=0, description="strength of the pull towards the reference (the KL weight)")
    loss_type: Literal[DPO_LOSS_TYPES] = Field("sigmoid", description="trl's DPOConfig.loss_type")
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="probability that a preference label is flipped (robust) / the smoothing of exo_pair (> 0 there)",
    )
    max_response_length: int = Field(
        192,
        ge=1,
        description="tokens of each chosen and rejected response kept (cut at the end); prompts are cut to "
        "ppo.max_prompt_length from the left, as for sampling",
    )

    @model_validator(mode="after")
    def _exo_needs_smoothing(self) -> DPOSettings:
        if self.loss_type == "exo_pair" and self.label_smoothing == 0:
            raise ValueError("align.dpo.loss_type=exo_pair needs align.dpo.label_smoothing > 0 (e.g. 1e-3)")
        return self


class AlignConfig(Section):
    """Policy optimisation: which algorithm the ppo stage runs, and the settings of the trl ones. Sampling
    (temperature, top_k, top_p, max_new_tokens, max_prompt_length, stop_strings), the reward source and where the
    policy and checkpoints go are the `ppo` section's, so every algorithm samples the same way and writes the
    policy where evaluate reads it."""

    algorithm: Literal[ALGORITHMS] = Field(
        "ppo",
        description="ppo: the project's PPO engine (the ppo section); grpo, rloo: trl's GRPOTrainer / RLOOTrainer "
        "against the proxy reward model; dpo: trl's DPOTrainer on the train split's preference pairs",
    )
    steps: int = Field(20, ge=1, description="optimisation steps of grpo, rloo and dpo (ppo: ppo.steps)")
    batch_size: int = Field(
        8,
        ge=1,
        description="per step, over all processes: completions for grpo and rloo (batch_size / num_generations "
        "prompts), preference pairs for dpo",
    )
    learning_rate: float = Field(2e-5, gt=0, description="AdamW learning rate of grpo, rloo and dpo")
    lr_schedule: Literal["constant", "linear"] = Field(
        "constant", description="constant, or linear decay to 0 over `steps`"
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="training precision of grpo, rloo and dpo; bf16 mixed precision only on a CUDA device (auto: "
        "where it supports bf16); fp32 on CPUs",
    )
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in backward (less memory, more time); trl defaults it to on"
    )
    checkpoint_every: int = Field(
        8,
        ge=0,
        description="steps between Trainer checkpoints (in ppo.checkpoint_dir) of grpo, rloo and dpo; a killed run "
        "resumes from the last (0: none)",
    )
    steps_per_generation: int = Field(
        1,
        ge=1,
        description="grpo and rloo: optimisation steps per generation (trl's steps_per_generation): each generation "
        "samples batch_size * steps_per_generation completions and splits them into that many steps, as PPO "
        "splits a rollout into minibatches",
    )
    grpo: GRPOSettings = GRPOSettings()
    rloo: RLOOSettings = RLOOSettings()
    dpo: DPOSettings = DPOSettings()

    @model_validator(mode="after")
    def _groups_fill_the_batch(self) -> AlignConfig:
        if self.algorithm in ("grpo", "rloo"):
            n = getattr(self, self.algorithm).num_generations
            if (self.batch_size * self.steps_per_generation) % n:
                raise ValueError(
                    f"align.batch_size ({self.batch_size}) * align.steps_per_generation ({self.steps_per_generation}) "
                    f"must be a multiple of align.{self.algorithm}.num_generations ({n}): each generation samples "
                    "whole groups"
                )
        return self


def training_budget(algorithm: str, ppo, align: AlignConfig) -> dict[str, int]:
    """What an algorithm's run spends, from its settings: responses it generates, distinct prompts they answer (DPO:
    preference pairs it reads) and optimiser steps. Comparing algorithms like for like means equal figures here."""
    if algorithm == "ppo":
        return {
            "responses": ppo.steps * ppo.batch_size,
            "prompts": ppo.steps * ppo.batch_size // ppo.samples_per_prompt,
            "optimizer_steps": ppo.steps * ppo.ppo_epochs * (ppo.batch_size // ppo.mini_batch_size),
        }
    if algorithm == "dpo":
        return {"responses": 0, "prompts": align.steps * align.batch_size, "optimizer_steps": align.steps}
    generations = -(-align.steps // align.steps_per_generation)  # trl samples a new batch every that many steps
    responses = generations * align.batch_size * align.steps_per_generation
    return {
        "responses": responses,
        "prompts": responses // getattr(align, algorithm).num_generations,
        "optimizer_steps": align.steps,
    }
