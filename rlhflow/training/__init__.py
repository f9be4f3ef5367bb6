"""Training other than PPO: reward models and LLM judges (`reward_model`), SFT (`sft`), trl's GRPO, RLOO and DPO
(`align`), the glue around transformers' Trainer (`hf_trainer`) and data parallelism (`distributed`).
Import from those modules; this package imports none of them."""
