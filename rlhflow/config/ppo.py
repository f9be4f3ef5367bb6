"""params.yaml's `ppo` section: the PPO stage's settings (rlhflow/ppo/trainer.py reads them)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlhflow.config.lora import LoraConfig
from rlhflow.config.section import Section


class AdaptiveKLConfig(Section):
    enabled: bool = False
    target: float = Field(6.0, gt=0, description="target KL per response (nats)")
    horizon: int = Field(10_000, ge=1)


class PPOConfig(Section):
    steps: int = Field(20, ge=1, description="PPO updates (each one rollout batch)")
    batch_size: int = Field(
        8,
        ge=1,
        description="responses per rollout, over all processes of an `accelerate launch` "
        "(each of N takes batch_size / N)",
    )
    samples_per_prompt: int = Field(
        1,
        ge=1,
        description="responses sampled per prompt in a rollout: batch_size / samples_per_prompt distinct prompts "
        "per update (GRPO and RLOO sample such groups; PPO's baseline stays its critic)",
    )
    mini_batch_size: int = Field(4, ge=1, description="responses per optimisation step, over all processes")
    ppo_epochs: int = Field(1, ge=1, description="passes over each rollout batch")
    learning_rate: float = Field(2e-5, gt=0)
    lr_schedule: Literal["constant", "linear"] = Field(
        "constant",
        description="learning rate per update: constant, or linear: learning_rate * (1 - (u - 1) / steps) "
        "for update u, decaying to 0 at the end of the run (annealed per update, as TRL does)",
    )
    adam_eps: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    # sampling
    temperature: float = Field(0.7, gt=0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(48, ge=1)
    max_prompt_length: int = Field(192, ge=1)
    stop_strings: list[str] = Field(default_factory=list, description="extra stop strings besides EOS")
    kv_cache: Literal["preallocated", "dynamic", "compiled"] = Field(
        "preallocated",
        description="the KV cache of every sampling pass (PPO's rollouts, the SFT samples, the evaluation): "
        "preallocated: written in place into buffers sized for prompt and answer (rlhflow.models.kv_cache); "
        "dynamic: transformers' DynamicCache, which copies the whole cache at every decode step; compiled: "
        "transformers' StaticCache with the decode step under torch.compile (CUDA graphs on a GPU), rows and "
        "positions rounded up so it compiles a few times per run (slower than preallocated on a CPU)",
    )
    rollout_logprobs: Literal["auto", "generation", "forward"] = Field(
        "auto",
        description="where the rollout's old log-probs, entropy and shared-head values come from: the "
        "sampling pass's own logits and hidden states (one forward pass fewer per update) or a separate forward "
        "pass; auto: generation when the policy is float32 with exact float32 matmuls, forward in lower precision "
        "or with TF32 matmuls (CUDA), where KV-cache decoding and a full forward pass differ by more than rounding",
    )
    # advantage estimation
    gamma: float = Field(1.0, ge=0, le=1)
    # lam=1: every response token gets credit for the final score while the value head is still untrained;
    # with few updates (the CPU default) lam=0.95 leaves early tokens almost no signal (0.95^47 ~ 0.09)
    lam: float = Field(1.0, ge=0, le=1)
    whiten_advantages: bool = True
    reward_normalization: Literal["none", "whiten", "running", "sft"] = Field(
        "none",
        description="scores -> rewards: none; whiten: (score - mean) / std over each rollout batch; running: "
        "over all scores so far; sft: with the mean and std of the SFT policy's scores on reward_norm_prompts "
        "training prompts, sampled before the first update and fixed for the run (Huang et al., N+ details)",
    )
    reward_norm_prompts: int = Field(
        64,
        ge=1,
        description="reward_normalization=sft: training prompts whose SFT "
        "samples give the statistics (over all processes)",
    )
    # losses
    cliprange: float = Field(0.2, gt=0)
    cliprange_value: float | None = Field(0.2, gt=0)
    vf_coef: float = Field(0.1, ge=0)
    entropy_coef: float = Field(0.0, ge=0)
    # KL penalty against the reference
    kl_coef: float = Field(0.05, ge=0)
    kl_estimator: Literal["k1", "k3"] = "k1"
    adaptive_kl: AdaptiveKLConfig = AdaptiveKLConfig()
    missing_eos_penalty: float | None = Field(
        1.0, description="subtracted from the score of responses that never emit EOS or a stop string"
    )
    overlong_buffer: int = Field(
        0,
        ge=0,
        description="DAPO's overlong shaping: over the last overlong_buffer tokens before max_new_tokens the score "
        "falls linearly, to -overlong_penalty at the limit (rlhflow.ppo.core.overlong_penalty); 0: off",
    )
    overlong_penalty: float = Field(1.0, ge=0, description="overlong_buffer: the shaping's value at max_new_tokens")
    loss_aggregation: Literal["token_mean", "sequence_mean"] = Field(
        "token_mean",
        description="how the policy, value and entropy terms average their tokens: over all response tokens of the "
        "minibatch (token_mean), or per answer, then over answers (sequence_mean: short answers' tokens weigh more; "
        "rlhflow.ppo.core.aggregate)",
    )
    # reward source and models
    reward_fn: str | None = Field(
        None,
        description="'module:function' scoring (prompts, responses, **reward_fn_kwargs) -> list[float], "
        "e.g. 'rlhflow.ppo.reward_functions:contains_word'; default: the trained reward model. Another module than "
        "rlhflow.ppo.reward_functions runs only where $RLHFLOW_ALLOW_CODE names ppo.reward_fn",
    )
    reward_fn_kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for reward_fn")
    value_model: Literal["shared", "separate"] = Field(
        "shared", description="shared: a value head on the policy backbone; separate: a critic model of its own"
    )
    critic_init: Literal["auto", "reward_model", "sft"] = Field(
        "auto",
        description="the separate critic's start: a copy of the reward model (backbone and score head) or of "
        "the SFT model; auto: the reward model when it reads the policy's tokens (e.g. reward_model.backbone=sft), "
        "else the SFT model",
    )
    value_head_detach: bool = Field(
        True,
        description="shared value head: read the backbone's hidden state without a gradient (the value loss then "
        "trains the head alone and never moves the policy); false: the value loss also trains the backbone",
    )
    value_learning_rate: float | None = Field(
        1e-3,
        gt=0,
        description="AdamW learning rate of the value model (head or separate critic), on ppo.lr_schedule; unset: "
        "ppo.learning_rate",
    )
    lora: LoraConfig = Field(
        LoraConfig(), description="LoRA adapters; keys it does not set: the top-level lora section's"
    )
    checkpoint_every: int = Field(8, ge=0, description="updates between checkpoints (0: none)")
    out_dir: str = "models/policy"
    checkpoint_dir: str = "checkpoints/ppo"
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "fp32",
        description="bf16: autocast with fp32 master weights (the frozen reference and reward model held in bf16); "
        "log-probs, KL, advantages and losses in fp32; auto: bf16 where the device runs it natively (CUDA "
        "capability >= 8.0; a CPU with AVX512-BF16 or AMX), else fp32",
    )
    fp32_lm_head: bool = Field(
        False,
        description="bf16 only: the output layer (the logits) computed in fp32 in every model PPO samples from or "
        "scores with (policy, its sampling copy, reference), the rest in bf16",
    )
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass (less memory)")
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="responses per forward/backward pass inside each process's share of a minibatch (gradient "
        "accumulation); unset: the whole share at once",
    )

    @model_validator(mode="after")
    def _minibatches_divide_batch(self) -> PPOConfig:
        if self.batch_size % self.mini_batch_size:
            raise ValueError(
                f"ppo.batch_size ({self.batch_size}) must be a multiple of ppo.mini_batch_size ({self.mini_batch_size})"
            )
        if self.batch_size % self.samples_per_prompt:
            raise ValueError(
                f"ppo.batch_size ({self.batch_size}) must be a multiple of ppo.samples_per_prompt "
                f"({self.samples_per_prompt}): each prompt of a rollout is sampled that many times"
            )
        return self

    @model_validator(mode="after")
    def _overlong_buffer_fits_the_answer(self) -> PPOConfig:
        if self.overlong_buffer >= self.max_new_tokens:
            raise ValueError(
                f"ppo.overlong_buffer ({self.overlong_buffer}) must be below ppo.max_new_tokens "
                f"({self.max_new_tokens}): the shaping covers the last overlong_buffer tokens before the limit"
            )
        return self
