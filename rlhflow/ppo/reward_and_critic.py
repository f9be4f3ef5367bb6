"""What a PPO run starts from, as the config chooses it: the reward source (a programmatic `ppo.reward_fn` or the
trained reward model, held in the run's precision) and the separate critic's initial weights (`ppo.critic_init`)."""

from __future__ import annotations

from pathlib import Path

import torch

from rlhflow.config.ppo import PPOConfig
from rlhflow.models.loading import autocast, linear_weights_to
from rlhflow.models.policy import Critic
from rlhflow.ppo.reward_functions import load_reward_fn
from rlhflow.training.reward_model import RewardModel


def load_reward_source(ppo: PPOConfig, reward_model_dir: Path, *, batch_size: int, device):
    """(score_fn, reward model): ppo.reward_fn when set (no reward model), else the normalised score of the trained
    reward model in `reward_model_dir`, scoring `batch_size` responses at a time."""
    if ppo.reward_fn:
        fn = load_reward_fn(ppo.reward_fn, ppo.reward_fn_kwargs)
        return lambda prompts, responses: torch.as_tensor(list(fn(prompts, responses)), dtype=torch.float32), None
    rm = RewardModel.load(reward_model_dir, batch_size=batch_size, device=device)
    return rm.score, rm


def in_precision(score_fn, reward_model, dtype: torch.dtype):
    """The reward model's score_fn in the run's precision: bf16 holds the frozen model's linear weights in bf16 and
    scores under autocast (the score is read in fp32); fp32, or no reward model, leaves both as they are. Call it
    after `make_critic`, which copies the reward model's fp32 weights."""
    if reward_model is None or dtype == torch.float32:
        return score_fn
    linear_weights_to(reward_model.model, dtype)

    def score(prompts, responses):
        with autocast(reward_model.device, dtype):
            return score_fn(prompts, responses)

    return score


def make_critic(ppo: PPOConfig, reward_model, policy_tokenizer):
    """The separate critic's start (ppo.critic_init): a copy of the reward model when it reads the policy's tokens,
    else None (the trainer copies the SFT backbone)."""
    if ppo.value_model != "separate" or ppo.critic_init == "sft":
        return None
    if reward_model is None:
        why_not = "ppo.reward_fn replaces the reward model"
    elif reward_model.tokenizer.get_vocab() != policy_tokenizer.get_vocab():
        why_not = "the reward model's tokenizer is not the policy's"
    else:
        try:
            critic = Critic.from_reward_model(reward_model.model, reward_model.mean, reward_model.std)
            print("ppo: the critic starts from the reward model", flush=True)
            return critic
        except ValueError as err:
            why_not = str(err)
    if ppo.critic_init == "reward_model":
        raise ValueError(f"ppo.critic_init=reward_model: {why_not}")
    print(f"ppo: the critic starts from the SFT model ({why_not})", flush=True)
    return None
