"""The PPO engine (`PPOTrainer`): rollout, advantages, clipped updates, KL control, checkpoints.

One update: sample a batch and measure it (`_collect`), turn scores and the KL to the reference into per-token
rewards, advantages and returns (`_rollout`), `ppo_epochs` passes of clipped updates over shuffled minibatches
(`_optimize`), then the KL coefficient, the logged statistics and a checkpoint (`update`). The math, every option,
precision and the logged statistics: docs/ppo.md.
"""

from __future__ import annotations

import copy
import os
import random
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from rlhflow.config.params import PPOConfig
from rlhflow.models.generation import GenerationOutput, generate
from rlhflow.models.loading import (
    add_lora,
    checkpoint_activations,
    copy_weights_into,
    disable_dropout,
    fp32_matmuls_exact,
    is_peft,
    linear_weights_to,
    output_layer_in_fp32,
    resolve_precision,
)
from rlhflow.models.policy import Critic, PolicyAndValue, encode_prompts, sequence_logprobs
from rlhflow.ppo import core
from rlhflow.ppo.checkpoints import Checkpoints, repo_path
from rlhflow.progress import ProgressLines
from rlhflow.training import distributed

ScoreFn = Callable[[list, list[str]], "torch.Tensor | Sequence[float]"]
# sampling seeds of the reward-normalisation samples: a stream apart from the updates' (1, 2, ...)
_SFT_SAMPLES_STREAM = 2**31


class NonFiniteError(RuntimeError):
    """A loss, score or KL became NaN/inf; the message names the quantity and the update."""

    def __init__(self, quantity: str, update: int):
        super().__init__(f"non-finite {quantity} in PPO update {update}; no checkpoint was written for it")
        self.quantity, self.update = quantity, update


@dataclass
class Experience:
    """One rollout before rewards: what was sampled (`gen`, with its response mask and the first epoch's row order)
    and measured on it (old log-probs, values and entropy; the reference's log-probs; this process's raw scores and
    the global batch's), with the phases' timings."""

    gen: GenerationOutput
    mask: torch.Tensor
    order: torch.Tensor
    old_logprobs: torch.Tensor
    old_values: torch.Tensor
    entropy: torch.Tensor
    ref_logprobs: torch.Tensor
    raw_scores: torch.Tensor
    all_raw_scores: torch.Tensor
    timings: dict[str, float]


class PPOTrainer(Checkpoints):
    def __init__(
        self,
        cfg: PPOConfig,
        *,
        policy: torch.nn.Module,
        tokenizer,
        score_fn: ScoreFn,
        prompts: Sequence[list[dict]],
        ref_policy: torch.nn.Module | None = None,
        device: str | torch.device = "cpu",
        seed: int = 0,
        log_fn: Callable[[dict[str, float], int], None] | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        critic: Critic | None = None,
    ):
        """checkpoint_dir overrides cfg.checkpoint_dir (relative paths are relative to the repository root).
        critic: the value model when cfg.value_model is "separate" (e.g. `Critic.from_reward_model`); default: a
        copy of the policy's backbone with a zero value head."""
        self._check_settings(cfg, tokenizer, prompts)
        self.cfg, self.tokenizer, self.score_fn, self.log_fn = cfg, tokenizer, score_fn, log_fn
        self.prompts = list(prompts)
        self.device = torch.device(device)
        self.seed = seed
        self.checkpoint_dir = repo_path(checkpoint_dir if checkpoint_dir is not None else cfg.checkpoint_dir)
        self.dtype = resolve_precision(cfg.precision, self.device)  # what the forward passes' matmuls run in
        mixed = self.dtype != torch.float32
        if mixed and cfg.rollout_logprobs == "generation":
            raise ValueError(
                f"ppo.rollout_logprobs=generation with ppo.precision={cfg.precision} ({self.dtype}): KV-cache decoding "
                "and a full forward pass differ by more than rounding there, so the first ratio pi / pi_old would not "
                "be 1; use rollout_logprobs=forward (or auto)"
            )

        policy = self._build_models(policy, ref_policy, critic)
        self._shard_batches()
        self.sum_across = distributed.sum_across if self.world_size > 1 else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # float32 decoding matches a full forward pass up to rounding; in bf16 or with TF32 matmuls they differ more
        exact_fp32 = not mixed and next(policy.parameters()).dtype == torch.float32 and fp32_matmuls_exact(self.device)
        self.logprobs_from_generation = cfg.rollout_logprobs == "generation" or (
            cfg.rollout_logprobs == "auto" and exact_fp32
        )
        self._build_optimizer()
        if cfg.adaptive_kl.enabled:
            self.kl_ctl = core.AdaptiveKLController(cfg.kl_coef, cfg.adaptive_kl.target, cfg.adaptive_kl.horizon)
        else:
            self.kl_ctl = core.FixedKLController(cfg.kl_coef)
        self.running_scores = core.RunningMoments()
        self.sft_scores = core.RunningMoments()  # reward_normalization=sft: filled once, before the first update

        self.step = 0  # updates done
        self.history: list[dict[str, float]] = []
        self.py_rng = random.Random(seed)  # prompt order
        self.generator = torch.Generator().manual_seed(seed)  # minibatch shuffles
        self._prompt_queue: list[int] = []  # what is left of the current shuffled pass over the prompts

    def _check_settings(self, cfg: PPOConfig, tokenizer, prompts: Sequence[list[dict]]):
        """Settings that cannot train, refused before any model is touched; truncated sampling warned of."""
        if not prompts:
            raise ValueError("PPOTrainer needs at least one prompt")
        if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
            raise ValueError(
                "the tokenizer needs a pad token distinct from EOS (see rlhflow.models.loading.prepare_tokenizer)"
            )
        if cfg.top_k > 0 or cfg.top_p < 1:
            # generate samples from the truncated distribution, the log-probs are of the full one
            warnings.warn(
                f"ppo.top_k={cfg.top_k}, ppo.top_p={cfg.top_p}: sampling is truncated, but PPO's ratios and KL use the "
                "full softmax(logits / temperature), so the rollouts are off-policy for them; use top_k=0, top_p=1.0 "
                "for on-policy PPO",
                stacklevel=3,
            )

    def _build_models(
        self, policy: torch.nn.Module, ref_policy: torch.nn.Module | None, critic: Critic | None
    ) -> torch.nn.Module:
        """The policy with its value model (`self.model`), the frozen reference and, in bf16, the sampling copy;
        returns the policy as trained (LoRA-wrapped where enabled)."""
        cfg, mixed = self.cfg, self.dtype != torch.float32
        policy = disable_dropout(policy).to(self.device)
        if mixed:
            policy = policy.float()  # the fp32 master weights autocast reads
            if cfg.fp32_lm_head:  # before any copy: the reference and the sampling copy inherit it
                policy = output_layer_in_fp32(policy)
                if ref_policy is not None:
                    ref_policy = output_layer_in_fp32(ref_policy)
        if cfg.value_model != "separate":
            critic = None
        elif critic is None:  # a copy of the SFT backbone, taken before any adapter is added
            critic = Critic.from_policy(policy)
        if critic is not None:
            critic = disable_dropout(critic).to(self.device)
            if mixed:
                critic = critic.float()
        if cfg.lora.enabled:
            policy = add_lora(policy, cfg.lora, seed=self.seed)
            if critic is not None:
                critic.backbone = add_lora(critic.backbone, cfg.lora, seed=self.seed)
            if cfg.lora.dropout > 0:
                warnings.warn(
                    "ppo.lora.dropout > 0 is inactive: PPO runs every model in eval mode (no dropout)", stacklevel=3
                )
        # the reference: given, or with LoRA the adapter-free base (no copy), else a frozen copy of the start policy;
        # in bf16 its linear weights are held in bf16, the values autocast computes with anyway
        if ref_policy is None and not is_peft(policy):
            ref_policy = copy.deepcopy(policy)
        if ref_policy is not None:
            ref_policy = disable_dropout(ref_policy).to(self.device).eval().requires_grad_(False)
            ref_policy = linear_weights_to(ref_policy, self.dtype)
        self.ref_policy = ref_policy
        # bf16: rollouts sample from a copy with bf16 linear weights, refreshed before each rollout: under autocast it
        # computes exactly what the master weights compute, without casting each weight at every decode step (not LoRA)
        self.sampler = None
        if mixed and not is_peft(policy):
            self.sampler = linear_weights_to(copy.deepcopy(policy), self.dtype).eval().requires_grad_(False)

        self.model = PolicyAndValue(
            policy, cfg.value_model, critic, compute_dtype=self.dtype, detach_value_input=cfg.value_head_detach
        )
        self.model = self.model.to(self.device).eval()
        disable_dropout(self.model)  # LoRA's dropout too: training may switch to train mode (checkpointing)
        if cfg.gradient_checkpointing:
            checkpoint_activations(policy)
            if critic is not None:
                checkpoint_activations(critic.backbone)
        return policy

    def _shard_batches(self):
        """Data parallelism (a no-op in one process): every process starts from rank 0's weights, takes its shard
        of each global batch (ppo.batch_size and ppo.mini_batch_size are global), and sums its gradients and
        statistics with the others', so an update is the one a single process would make on the global batch."""
        cfg = self.cfg
        distributed.broadcast_parameters(self.model)
        self.rank, self.world_size = distributed.rank(), distributed.world_size()
        self.local_batch_size = distributed.shard_size(cfg.batch_size, "ppo.batch_size")
        self.local_mini_batch_size = distributed.shard_size(cfg.mini_batch_size, "ppo.mini_batch_size")
        self.micro_batch_size = cfg.micro_batch_size or self.local_mini_batch_size  # rows per forward/backward pass
        if self.local_mini_batch_size % self.micro_batch_size:
            share = "" if self.world_size == 1 else f" / {self.world_size} processes = {self.local_mini_batch_size}"
            raise ValueError(
                f"ppo.micro_batch_size ({cfg.micro_batch_size}) must divide ppo.mini_batch_size "
                f"({cfg.mini_batch_size}{share}): a minibatch's gradient is accumulated over whole micro-batches"
            )

    def _build_optimizer(self):
        """AdamW over the policy's and the value model's trainable parameters."""
        cfg = self.cfg
        # the fused kernel: one pass over each tensor instead of a dozen (same update rule; ~1.8x faster on CPU)
        fused = self.device.type in ("cpu", "cuda") and all(p.is_floating_point() for p in self.params)
        # two groups: the value model may learn at its own rate (ppo.value_learning_rate); equal rates, one update rule
        value_ids = {id(p) for p in self.model.value_module().parameters()}
        groups = [
            {"params": [p for p in self.params if id(p) not in value_ids], "base_lr": cfg.learning_rate},
            {
                "params": [p for p in self.params if id(p) in value_ids],
                "base_lr": cfg.value_learning_rate or cfg.learning_rate,
            },
        ]
        self.optimizer = torch.optim.AdamW(
            [{**g, "lr": g["base_lr"]} for g in groups if g["params"]],
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            fused=fused or None,
        )

    @property
    def policy(self) -> torch.nn.Module:
        return self.model.policy

    # ---- rollout ---------------------------------------------------------------------------------

    def _next_prompts(self) -> list[int]:
        """This process's shard of the rollout's batch_size prompt indices: batch_size / samples_per_prompt distinct
        prompts, each repeated samples_per_prompt times, cycling through seeded shuffles of the whole prompt set
        (every process draws the same global batch and keeps its own slice)."""
        k = self.cfg.samples_per_prompt
        distinct = self.cfg.batch_size // k
        while len(self._prompt_queue) < distinct:
            order = list(range(len(self.prompts)))
            self.py_rng.shuffle(order)
            self._prompt_queue.extend(order)
        drawn, self._prompt_queue = self._prompt_queue[:distinct], self._prompt_queue[distinct:]
        idx = [i for i in drawn for _ in range(k)]
        start = self.rank * self.local_batch_size
        return idx[start : start + self.local_batch_size]

    def _micro_batches(self, order: torch.Tensor) -> list[torch.Tensor]:
        """The row groups of one epoch: minibatches of `order`, each split into its micro-batches."""
        return [
            micro for mini in order.split(self.local_mini_batch_size) for micro in mini.split(self.micro_batch_size)
        ]

    def _in_chunks(self, fn, qr, am, context_length, T, groups: list[torch.Tensor]):
        """Run fn(qr, am, ctx) -> tensors [b, t] over the row groups (padding trimmed), scattered back to [B, T]:
        the groups training's forward passes will see, so both compute on identical inputs."""
        outs = None
        for rows in groups:
            q, a, ctx, _ = core.trim_padding(qr[rows], am[rows], context_length)
            parts = fn(q, a, ctx)
            if outs is None:
                outs = [p.new_zeros((qr.shape[0], T)) for p in parts]
            for out, part in zip(outs, parts):
                out[rows] = core.pad_to(part, T)
        return outs

    def _ref_logprobs(self, q, a, ctx):
        t, dtype = self.cfg.temperature, self.dtype
        if self.ref_policy is not None:
            return (sequence_logprobs(self.ref_policy, q, a, ctx, t, compute_dtype=dtype),)
        with self.policy.disable_adapter():  # LoRA: the reference is the base weights
            return (sequence_logprobs(self.policy, q, a, ctx, t, compute_dtype=dtype),)

    def _sample(self, messages: list, *, stream: int, **outputs):
        """The policy's responses to `messages`, sampled with the PPO settings, from the random stream `stream`
        of this run and process (reproducible, and apart from every other stream); `outputs`: generate's
        return_logits / return_hidden."""
        cfg, dev = self.cfg, self.device
        input_ids, prompt_mask = encode_prompts(self.tokenizer, messages, cfg.max_prompt_length)
        if self.sampler is not None:
            copy_weights_into(self.sampler, self.policy)  # the current master weights
        return generate(
            self.sampler if self.sampler is not None else self.policy,
            self.tokenizer,
            input_ids.to(dev),
            prompt_mask.to(dev),
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            stop_strings=cfg.stop_strings,
            generator_seed=(self.seed * 1_000_003 + stream) * self.world_size + self.rank,
            compute_dtype=self.dtype,
            kv_cache=cfg.kv_cache,
            **outputs,
        )

    @torch.no_grad()
    def _rollout(self, update: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """One batch of experience: sample and score (`_collect`), then the per-token rewards r_t = score at the last
        token - beta * KL_t, and GAE's advantages and returns (docs/ppo.md, Rollout)."""
        cfg = self.cfg
        x = self._collect(update)
        scores = self._normalised(self._shaped(x.raw_scores, x.gen))
        kl = core.kl_per_token(x.old_logprobs, x.ref_logprobs, cfg.kl_estimator) * x.mask
        if self._on_any_process(~torch.isfinite(kl).all()):
            raise NonFiniteError("KL", update)
        kl_coef = self.kl_ctl.value
        rewards = core.per_token_rewards(scores, kl, kl_coef, x.mask)
        advantages, returns = core.gae(rewards, x.old_values, x.mask, cfg.gamma, cfg.lam)
        stats = self._rollout_stats(x, rewards, kl, kl_coef, advantages, returns)
        if cfg.whiten_advantages:
            advantages = core.masked_whiten(advantages, x.mask, sum_across=self.sum_across)
        batch = dict(
            query_response=x.gen.query_response,
            attention_mask=x.gen.attention_mask,
            mask=x.mask,
            logprobs=x.old_logprobs,
            values=x.old_values,
            advantages=advantages,
            returns=returns,
            order=x.order,
        )
        batch["context_length"] = x.gen.context_length
        return batch, stats

    def _collect(self, update: int) -> Experience:
        """Sample this process's share of the batch, then the old log-probs, values and entropy, the reference's
        log-probs and the raw scores; a non-finite score stops the run."""
        cfg, dev = self.cfg, self.device
        messages = [self.prompts[i] for i in self._next_prompts()]
        t0 = time.perf_counter()
        shared = cfg.value_model == "shared"
        gen = self._sample(
            messages,
            stream=update,  # a fresh, reproducible stream per update and process
            return_logits=self.logprobs_from_generation,
            return_hidden=self.logprobs_from_generation and shared,
        )
        t1 = time.perf_counter()
        qr, am, ctx = gen.query_response, gen.attention_mask, gen.context_length
        B, T = gen.response.shape
        # the first epoch's minibatch order, drawn now: the forward passes below run on its micro-batches
        order = torch.randperm(B, generator=self.generator).to(dev)
        groups = self._micro_batches(order)
        if self.logprobs_from_generation:
            # old log-probs, entropy (and shared-head values) from the sampling pass; a separate critic runs its own
            values = (
                None
                if shared
                else self._in_chunks(lambda q, a, c: (self.model.critic_values(q, a, c),), qr, am, ctx, T, groups)[0]
            )
            old_logprobs, old_values, entropy = self.model.from_generation(gen, cfg.temperature, values)
        else:  # old log-probs, values and entropy in one forward pass (shared head; a critic adds its own)
            old_logprobs, old_values, entropy = self._in_chunks(
                lambda q, a, c: self.model(q, a, c, cfg.temperature, return_entropy=True), qr, am, ctx, T, groups
            )
        (ref_logprobs,) = self._in_chunks(self._ref_logprobs, qr, am, ctx, T, groups)
        t2 = time.perf_counter()
        raw_scores = torch.as_tensor(self.score_fn(messages, gen.texts), dtype=torch.float32).to(dev).flatten()
        t3 = time.perf_counter()
        if raw_scores.shape[0] != len(messages):
            raise ValueError(f"score_fn returned {raw_scores.shape[0]} scores for {len(messages)} responses")
        all_raw_scores = distributed.gather(raw_scores)  # the global batch's scores, for global statistics
        if not torch.isfinite(all_raw_scores).all():
            raise NonFiniteError("score", update)
        timings = {"time/generation_s": t1 - t0, "time/forward_s": t2 - t1, "time/scoring_s": t3 - t2}
        return Experience(
            gen=gen,
            mask=gen.response_mask.float(),
            order=order,
            old_logprobs=old_logprobs,
            old_values=old_values,
            entropy=entropy,
            ref_logprobs=ref_logprobs,
            raw_scores=raw_scores,
            all_raw_scores=all_raw_scores,
            timings=timings,
        )

    def _shaped(self, raw_scores: torch.Tensor, gen) -> torch.Tensor:
        """The sequence reward before normalisation: the score, less missing_eos_penalty for an answer that never
        ended, plus the overlong shaping near the answer limit (core.overlong_penalty; off by default)."""
        cfg = self.cfg
        scores = core.penalize_missing_eos(raw_scores, gen.ended, cfg.missing_eos_penalty)
        if cfg.overlong_buffer:
            lengths = gen.response_mask.sum(1)
            scores = scores + core.overlong_penalty(
                lengths, cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty
            )
        return scores

    def _normalised(self, scores: torch.Tensor) -> torch.Tensor:
        """The scores as `reward_normalization` sets them: whitened over the batch, by running moments, by the SFT
        policy's score moments (fitted once, before the first update), or as they are."""
        norm = self.cfg.reward_normalization
        if norm == "whiten":
            return core.masked_whiten(scores, torch.ones_like(scores), sum_across=self.sum_across)
        if norm == "running":
            self.running_scores.update(distributed.gather(scores))
            return self.running_scores.normalize(scores)
        if norm == "sft":
            return self.sft_scores.normalize(scores)  # (score - mean_sft) / std_sft, the same for the whole run
        return scores

    def _rollout_stats(self, x: Experience, rewards, kl, kl_coef: float, advantages, returns) -> dict[str, float]:
        """The rollout's logged statistics, over the global batch."""
        mask = x.mask

        def token_mean(v: torch.Tensor) -> float:  # over all response tokens of the global batch
            return core.masked_mean(v, mask, sum_across=self.sum_across).item()

        def response_mean(v: torch.Tensor) -> float:  # over all responses of the global batch
            return core.masked_mean(v.float(), torch.ones_like(v, dtype=torch.float), sum_across=self.sum_across).item()

        stats = {
            "ppo/score_mean": x.all_raw_scores.mean().item(),
            "ppo/score_std": x.all_raw_scores.std(correction=0).item(),
            "ppo/reward_total_mean": response_mean(rewards.sum(1)),
            "ppo/kl": response_mean(kl.sum(1)),
            "ppo/kl_coef": kl_coef,
            "ppo/entropy": token_mean(x.entropy),
            "ppo/returns_mean": token_mean(returns),
            "ppo/advantages_mean": token_mean(advantages),  # before whitening
            # the rollout's values against the returns they are trained towards, before this update's epochs
            "ppo/explained_variance": float(core.explained_variance(x.old_values, returns, mask, self.sum_across)),
            "ppo/response_length": response_mean(mask.sum(1)),
            "ppo/eos_fraction": response_mean(x.gen.ended),
            "ppo/responses": float(x.all_raw_scores.numel()),  # the global batch: responses over all processes
            **x.timings,
        }
        if self.cfg.reward_normalization == "sft":
            stats.update({"ppo/reward_norm_mean": self.sft_scores.mean, "ppo/reward_norm_std": self.sft_scores.std})
        return stats

    @torch.no_grad()
    def _fit_sft_scores(self) -> None:
        """The statistics of reward_normalization=sft: score responses of the initial (SFT) policy to
        reward_norm_prompts training prompts, sampled as rollouts sample, penalised as rollouts are."""
        cfg, dev = self.cfg, self.device
        n_local = distributed.shard_size(cfg.reward_norm_prompts, "ppo.reward_norm_prompts")
        order = list(range(len(self.prompts)))
        random.Random(self.seed).shuffle(order)  # a stream of its own: the rollouts' prompt order is unchanged
        idx = [order[i % len(order)] for i in range(cfg.reward_norm_prompts)]
        idx = idx[self.rank * n_local : (self.rank + 1) * n_local]  # this process's share
        scores = []
        for batch, start in enumerate(range(0, len(idx), self.local_batch_size)):
            messages = [self.prompts[i] for i in idx[start : start + self.local_batch_size]]
            gen = self._sample(messages, stream=_SFT_SAMPLES_STREAM + batch)
            raw = torch.as_tensor(self.score_fn(messages, gen.texts), dtype=torch.float32).to(dev).flatten()
            scores.append(self._shaped(raw, gen))
        all_scores = distributed.gather(torch.cat(scores))
        if not torch.isfinite(all_scores).all():
            raise NonFiniteError("score of an SFT sample", 1)
        self.sft_scores.update(all_scores)

    def _on_any_process(self, flag: torch.Tensor) -> bool:
        """Whether `flag` is true in any process (so that all of them raise together, none waits forever)."""
        if self.sum_across is None:
            return bool(flag)
        return bool(self.sum_across(flag.float().reshape(1).to(self.device)) > 0)

    # ---- optimisation ----------------------------------------------------------------------------

    def _optimize(self, batch: dict, update: int) -> dict[str, float]:
        cfg = self.cfg
        B = batch["query_response"].shape[0]  # this process's rows
        sums: dict[str, float] = {}
        n = 0
        # gradient checkpointing recomputes activations only in train mode (dropout is off either way)
        self.model.train(cfg.gradient_checkpointing)
        try:
            for epoch in range(cfg.ppo_epochs):
                order = batch["order"] if epoch == 0 else torch.randperm(B, generator=self.generator).to(self.device)
                for start in range(0, B, self.local_mini_batch_size):
                    stats = self._minibatch_gradients(batch, order[start : start + self.local_mini_batch_size], update)
                    distributed.sum_gradients(self.params)
                    torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm)
                    self.optimizer.step()
                    for key, value in stats.items():
                        sums[key] = sums.get(key, 0.0) + value
                    n += 1
        finally:
            self.model.eval()
            self.optimizer.zero_grad(set_to_none=True)
        if self.sum_across is not None:  # each process holds its share of each minibatch mean: add them up
            keys = sorted(sums)
            sums = dict(zip(keys, self.sum_across(torch.tensor([sums[k] for k in keys], device=self.device)).tolist()))
        return {f"ppo/{k}": v / n for k, v in sums.items()}

    def _minibatch_gradients(self, batch: dict, rows: torch.Tensor, update: int) -> dict[str, float]:
        """Leave in .grad the gradient of the minibatch `rows`' loss, accumulated over its micro-batches; return
        this process's share of the minibatch's statistics.

        Each term of the loss is a mean over the minibatch's N units (over all processes): its response tokens, or
        its answers under `loss_aggregation: sequence_mean`. The loss of a micro-batch j with n_j units, a mean over
        those, is weighted by n_j / N, and sum_j (n_j / N) L_j = L. The accumulated gradient is the whole
        minibatch's, up to rounding (and with several processes, the sum over them is the global minibatch's)."""
        cfg, ctx = self.cfg, batch["context_length"]
        how = cfg.loss_aggregation
        units = core.aggregation_units(batch["mask"][rows], how)  # N
        if self.sum_across is not None:
            units = self.sum_across(units)
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        nonfinite = False
        for micro in rows.split(self.micro_batch_size):
            qr, am, c, t = core.trim_padding(batch["query_response"][micro], batch["attention_mask"][micro], ctx)
            mask = batch["mask"][micro][:, :t]
            logprobs, values, entropy = self.model(qr, am, c, cfg.temperature, return_entropy=cfg.entropy_coef > 0)
            pg_loss, clipfrac, approxkl = core.policy_loss(
                logprobs, batch["logprobs"][micro][:, :t], batch["advantages"][micro][:, :t], mask, cfg.cliprange, how
            )
            vf_loss, vf_clipfrac = core.value_loss(
                values, batch["values"][micro][:, :t], batch["returns"][micro][:, :t], mask, cfg.cliprange_value, how
            )
            loss = pg_loss + cfg.vf_coef * vf_loss
            if cfg.entropy_coef > 0:
                loss = loss - cfg.entropy_coef * core.aggregate(entropy, mask, how)  # entropy bonus
            weight = core.aggregation_units(mask, how) / units.clamp(min=1.0)  # n_j / N
            if not torch.isfinite(loss):
                nonfinite = True
                break
            (loss * weight).backward()
            for key, value in (
                ("policy_loss", pg_loss),
                ("value_loss", vf_loss),
                ("clipfrac", clipfrac),
                ("approxkl", approxkl),
                ("value_clipfrac", vf_clipfrac),
            ):
                sums[key] = sums.get(key, 0.0) + float(value.detach() * weight)
        if self._on_any_process(torch.tensor(nonfinite)):
            raise NonFiniteError("loss", update)
        return sums

    def update(self) -> dict[str, float]:
        """One PPO update (rollout + optimisation + KL control); returns its stats."""
        update = self.step + 1
        if self.cfg.reward_normalization == "sft" and self.sft_scores.count == 0:
            if self.step > 0:
                raise ValueError("reward_normalization=sft needs the SFT score statistics, which the checkpoint lacks")
            self._fit_sft_scores()  # no update yet: the policy is the SFT model
        for group in self.optimizer.param_groups:
            group["lr"] = core.learning_rate(group["base_lr"], update, self.cfg.steps, self.cfg.lr_schedule)
        batch, stats = self._rollout(update)
        t0 = time.perf_counter()
        stats.update(self._optimize(batch, update))
        stats["time/training_s"] = time.perf_counter() - t0
        stats["ppo/lr"] = self.optimizer.param_groups[0]["lr"]
        self.kl_ctl.update(stats["ppo/kl"], n_steps=self.cfg.batch_size)
        self.step = update
        self.history.append(stats)
        if self.log_fn is not None:
            self.log_fn(stats, update)
        if self.cfg.checkpoint_every and update % self.cfg.checkpoint_every == 0 and distributed.is_main_process():
            self.save_checkpoint()  # every process holds the same state: rank 0's checkpoint resumes them all
        return stats

    def train(self) -> list[dict[str, float]]:
        """Run (or resume, from the latest checkpoint in cfg.checkpoint_dir) until cfg.steps updates are done."""
        if self.step == 0:  # a fresh trainer picks up where an interrupted run left off
            self.load_checkpoint()
        bar = tqdm(
            total=self.cfg.steps,
            initial=self.step,
            desc="ppo",
            unit="update",
            disable=not distributed.is_main_process(),
        )
        lines = ProgressLines("ppo") if distributed.is_main_process() else None  # the run log's view of the bar
        try:
            while self.step < self.cfg.steps:
                stats = self.update()
                bar.set_postfix(reward=f"{stats['ppo/score_mean']:.3f}", kl=f"{stats['ppo/kl']:.3f}")
                bar.update(1)
                if lines:
                    lines(
                        f"update {self.step} of {self.cfg.steps}: reward {stats['ppo/score_mean']:.3f}, "
                        f"KL {stats['ppo/kl']:.3f}"
                    )
        finally:
            bar.close()
        return self.history


__all__ = ["NonFiniteError", "PPOTrainer"]
