"""The ML library of the RLHF pipeline: preference data (data/), its validation, models and tokenizers, the policy
and sampling, reward models, SFT, PPO (ppo/) and the trl algorithms (align), metrics, statistics, evaluation and
the champion rule. It knows nothing of Prefect, DVC or the MLflow registry: that machinery is rlhfops.
"""
