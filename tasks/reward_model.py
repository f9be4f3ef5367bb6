"""Stage reward_model: train the proxy Bradley-Terry reward model with trl's RewardTrainer on the validated train
pairs, report pairwise accuracy (with its interval, beside the length rule) on the held-out test pairs, and register
the model as `rlhf-reward-model` (alias `candidate`). PPO optimises against this model; the judge stage trains
another one."""

from __future__ import annotations

from rlhflow.config.params import Config
from rlhfops.stage_runner import StageContext, cli, stage_task
from tasks.pairwise_training import train_pairwise_model

# A light door: mlflow (the registry's names) is imported inside run, torch, transformers, trl and pandas by
# tasks/pairwise_training.py where it trains, so the stage's --help and its checks answer before any of them loads.

NAME = "reward_model"


def run(cfg: Config, ctx: StageContext) -> dict[str, float]:
    from rlhfops import registry

    return train_pairwise_model(
        cfg,
        ctx,
        cfg.reward_model,
        split="train",
        prefix="rm",
        model_name=NAME,
        registered_name=registry.REWARD_MODEL,
        seed=cfg.seed,
        labelled_repeats=cfg.feedback.labelled_repeats,
    )


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
