"""PPO for RLHF: the math (`rlhflow.ppo.core`) and the engine (`rlhflow.ppo.trainer`)."""

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


def __getattr__(name):  # the trainer imports rlhflow.policy, which imports core: load it lazily
    if name in ("PPOTrainer", "NonFiniteError"):
        from rlhflow.ppo import trainer

        return getattr(trainer, name)
    raise AttributeError(name)
