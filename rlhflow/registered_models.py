"""Names of the models the stages register in the MLflow model registry (one place: stages and evaluation share
them without importing each other)."""

SFT = "rlhf-sft"
REWARD_MODEL = "rlhf-reward-model"
JUDGE = "rlhf-judge"
POLICY = "rlhf-policy"
