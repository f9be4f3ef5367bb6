"""PPO for RLHF: the math (`rlhflow.ppo.core`), the engine (`rlhflow.ppo.trainer`) and what a run starts from
(`rlhflow.ppo.setup`)."""

from rlhflow.ppo.core import (
    AdaptiveKLController,
    FixedKLController,
    RunningMoments,
    gae,
    kl_per_token,
    learning_rate,
    masked_mean,
    masked_var,
    masked_whiten,
    per_token_rewards,
    policy_loss,
    value_loss,
)
from rlhflow.ppo.trainer import NonFiniteError, PPOTrainer

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "NonFiniteError",
    "PPOTrainer",
    "RunningMoments",
    "gae",
    "kl_per_token",
    "learning_rate",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "per_token_rewards",
    "policy_loss",
    "value_loss",
]
