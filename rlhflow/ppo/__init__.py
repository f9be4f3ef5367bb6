"""PPO for RLHF: the math (`rlhflow.ppo.core`), the engine (`rlhflow.ppo.trainer`) and what a run starts from
(`rlhflow.ppo.reward_and_critic`). Import from those modules: this package imports none of them, so loading one
part (the math, say) does not load the trainer."""
