"""The PPO engine: rollout, advantages, clipped updates, KL control, checkpoints.

One update (`PPOTrainer.update`):
  1. rollout, no gradients: draw `batch_size` prompts, sample responses (temperature, top-k/p, EOS and stop
     strings); old log-probs, entropy and shared-head values from the sampling pass's logits and hidden states
     (`rollout_logprobs`; or a forward pass of their own), a separate critic's forward pass, and a forward pass
     for the reference log-probs (a frozen copy, or with LoRA the same model with the adapter disabled);
  2. score the decoded texts, subtract the missing-EOS penalty, normalise the scores (whiten: this batch's
     statistics; running: all scores so far; sft: fixed statistics of the SFT policy's scores, sampled before the
     first update);
  3. per-token rewards r_t = -beta * kl_t (+ score on the last token), GAE, whitened advantages;
  4. `ppo_epochs` passes over shuffled minibatches: clipped policy loss + vf_coef * clipped value loss
     - entropy_coef * entropy, gradient clipping, AdamW at this update's learning rate (constant or linear decay);
     with `micro_batch_size`, each minibatch's gradient is accumulated over micro-batches;
  5. update the KL coefficient, log the stats, checkpoint every `checkpoint_every` updates.
All models run without dropout (eval mode; train mode only for gradient checkpointing, which needs it).

Precision (`precision`, resolved by rlhflow.models.resolve_precision): bf16 runs the forward passes under autocast,
with fp32 master weights and fp32 AdamW state; the frozen reference and the copy rollouts sample from (refreshed
before each rollout) hold their linear weights in bf16, what autocast would cast them to; log-probs, KL, values,
advantages and losses are fp32, and `fp32_lm_head` makes the logits of all three fp32 too (output_layer_in_fp32).
The rollout's old log-probs come from training's forward pass on the same rows in the same order (the first epoch's
minibatches and micro-batches), so the first minibatch's ratio pi / pi_old starts at 1 in either precision.

Stats passed to log_fn(stats, update) after every update (means over the global batch when several processes
share it; the time/ entries are the main process's):
  ppo/score_mean, ppo/score_std   raw scores from score_fn (before the EOS penalty and normalisation)
  ppo/reward_total_mean           mean over responses of sum_t r_t (penalised, normalised score + KL penalty)
  ppo/kl, ppo/kl_coef             mean over responses of summed per-token KL (configured estimator); beta used
  ppo/entropy                     mean per-token entropy of the sampling policy (logits / temperature)
  ppo/policy_loss, ppo/value_loss, ppo/clipfrac, ppo/value_clipfrac, ppo/approxkl   means over minibatches
  ppo/returns_mean, ppo/advantages_mean   token means (advantages before whitening)
  ppo/explained_variance          1 - Var(returns - values) / Var(returns) over the rollout's tokens
  ppo/response_length, ppo/eos_fraction, ppo/lr
  ppo/reward_norm_mean, ppo/reward_norm_std   with reward_normalization=sft: the fixed SFT score statistics
  ppo/responses                   responses in the update over all processes (the global batch)
  time/generation_s (sampling), time/forward_s (old/ref log-probs and values), time/scoring_s (score_fn),
  time/training_s (the PPO epochs)
"""

from __future__ import annotations

import copy
import os
import random
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from rlhflow import distributed
from rlhflow.config import REPO_ROOT, PPOConfig
from rlhflow.models import (
    add_lora,
    checkpoint_activations,
    copy_weights_into,
    disable_dropout,
    fp32_matmuls_exact,
    is_peft,
    linear_weights_to,
    output_layer_in_fp32,
    resolve_precision,
    save_plain,
)
from rlhflow.policy import Critic, PolicyAndValue, encode_prompts, generate, sequence_logprobs
from rlhflow.ppo import core
from rlhflow.ppo.checkpoints import Checkpoints

ScoreFn = Callable[[list, list[str]], "torch.Tensor | Sequence[float]"]
# sampling seeds of the reward-normalisation samples: a stream apart from the updates' (1, 2, ...)
_SFT_SAMPLES_STREAM = 2**31


class NonFiniteError(RuntimeError):
    """A loss, score or KL became NaN/inf; the message names the quantity and the update."""

    def __init__(self, quantity: str, update: int):
        super().__init__(f"non-finite {quantity} in PPO update {update}; no checkpoint was written for it")
        self.quantity, self.update = quantity, update


def _resolve(path: str | os.PathLike) -> Path:
    """Relative paths are relative to the repository root, as everywhere in params.yaml."""
    p = Path(os.path.expanduser(str(path)))
    return p if p.is_absolute() else REPO_ROOT / p


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
        if not prompts:
            raise ValueError("PPOTrainer needs at least one prompt")
        if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
            raise ValueError("the tokenizer needs a pad token distinct from EOS (see rlhflow.models.prepare_tokenizer)")
        if cfg.top_k > 0 or cfg.top_p < 1:
            # generate samples from the truncated distribution, the log-probs are of the full one
            warnings.warn(
                f"ppo.top_k={cfg.top_k}, ppo.top_p={cfg.top_p}: sampling is truncated, but PPO's ratios and KL use the "
                "full softmax(logits / temperature), so the rollouts are off-policy for them; use top_k=0, top_p=1.0 "
                "for on-policy PPO",
                stacklevel=2,
            )
        self.cfg, self.tokenizer, self.score_fn, self.log_fn = cfg, tokenizer, score_fn, log_fn
        self.prompts = list(prompts)
        self.device = torch.device(device)
        self.seed = seed
        self.checkpoint_dir = _resolve(checkpoint_dir if checkpoint_dir is not None else cfg.checkpoint_dir)
        self.dtype = resolve_precision(cfg.precision, self.device)  # what the forward passes' matmuls run in
        mixed = self.dtype != torch.float32
        if mixed and cfg.rollout_logprobs == "generation":
            raise ValueError(
                f"ppo.rollout_logprobs=generation with ppo.precision={cfg.precision} ({self.dtype}): KV-cache decoding "
                "and a full forward pass differ by more than rounding there, so the first ratio pi / pi_old would not "
                "be 1; use rollout_logprobs=forward (or auto)"
            )

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
            policy = add_lora(policy, self.cfg.lora, seed=self.seed)
            if critic is not None:
                critic.backbone = add_lora(critic.backbone, self.cfg.lora, seed=self.seed)
            if cfg.lora.dropout > 0:
                warnings.warn(
                    "ppo.lora.dropout > 0 is inactive: PPO runs every model in eval mode (no dropout)", stacklevel=2
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
        # Data parallelism (a no-op in one process): every process starts from rank 0's weights, takes its shard
        # of each global batch (ppo.batch_size and ppo.mini_batch_size are global), and sums its gradients and
        # statistics with the others', so an update is the one a single process would make on the global batch.
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
        self.sum_across = distributed.sum_across if self.world_size > 1 else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # float32 decoding matches a full forward pass up to rounding; in bf16 or with TF32 matmuls they differ more
        exact_fp32 = not mixed and next(policy.parameters()).dtype == torch.float32 and fp32_matmuls_exact(self.device)
        self.logprobs_from_generation = cfg.rollout_logprobs == "generation" or (
            cfg.rollout_logprobs == "auto" and exact_fp32
        )
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
            **outputs,
        )

    @torch.no_grad()
    def _rollout(self, update: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        cfg, dev = self.cfg, self.device
        idx = self._next_prompts()
        messages = [self.prompts[i] for i in idx]

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
        mask = gen.response_mask.float()
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

        raw_scores = self.score_fn(messages, gen.texts)
        raw_scores = torch.as_tensor(raw_scores, dtype=torch.float32).to(dev).flatten()
        t3 = time.perf_counter()
        if raw_scores.shape[0] != len(messages):
            raise ValueError(f"score_fn returned {raw_scores.shape[0]} scores for {len(messages)} responses")
        all_raw_scores = distributed.gather(raw_scores)  # the global batch's scores, for global statistics
        if not torch.isfinite(all_raw_scores).all():
            raise NonFiniteError("score", update)

        scores = core.penalize_missing_eos(raw_scores, gen.ended, cfg.missing_eos_penalty)
        if cfg.reward_normalization == "whiten":
            scores = core.masked_whiten(scores, torch.ones_like(scores), sum_across=self.sum_across)
        elif cfg.reward_normalization == "running":
            self.running_scores.update(distributed.gather(scores))
            scores = self.running_scores.normalize(scores)
        elif cfg.reward_normalization == "sft":
            scores = self.sft_scores.normalize(scores)  # (score - mean_sft) / std_sft, the same for the whole run

        kl = core.kl_per_token(old_logprobs, ref_logprobs, cfg.kl_estimator) * mask
        if self._on_any_process(~torch.isfinite(kl).all()):
            raise NonFiniteError("KL", update)
        kl_coef = self.kl_ctl.value
        rewards = core.per_token_rewards(scores, kl, kl_coef, mask)
        advantages, returns = core.gae(rewards, old_values, mask, cfg.gamma, cfg.lam)

        def token_mean(x: torch.Tensor) -> float:  # over all response tokens of the global batch
            return core.masked_mean(x, mask, sum_across=self.sum_across).item()

        def response_mean(x: torch.Tensor) -> float:  # over all responses of the global batch
            return core.masked_mean(x.float(), torch.ones_like(x, dtype=torch.float), sum_across=self.sum_across).item()

        stats = {
            "ppo/score_mean": all_raw_scores.mean().item(),
            "ppo/score_std": all_raw_scores.std(correction=0).item(),
            "ppo/reward_total_mean": response_mean(rewards.sum(1)),
            "ppo/kl": response_mean(kl.sum(1)),
            "ppo/kl_coef": kl_coef,
            "ppo/entropy": token_mean(entropy),
            "ppo/returns_mean": token_mean(returns),
            "ppo/advantages_mean": token_mean(advantages),  # before whitening
            # the rollout's values against the returns they are trained towards, before this update's epochs
            "ppo/explained_variance": float(core.explained_variance(old_values, returns, mask, self.sum_across)),
            "ppo/response_length": response_mean(mask.sum(1)),
            "ppo/eos_fraction": response_mean(gen.ended),
            "ppo/responses": float(all_raw_scores.numel()),  # the global batch: responses over all processes
            "time/generation_s": t1 - t0,
            "time/forward_s": t2 - t1,
            "time/scoring_s": t3 - t2,
        }
        if cfg.reward_normalization == "sft":
            stats.update({"ppo/reward_norm_mean": self.sft_scores.mean, "ppo/reward_norm_std": self.sft_scores.std})
        if cfg.whiten_advantages:
            advantages = core.masked_whiten(advantages, mask, sum_across=self.sum_across)
        batch = dict(
            query_response=qr,
            attention_mask=am,
            mask=mask,
            logprobs=old_logprobs,
            values=old_values,
            advantages=advantages,
            returns=returns,
            order=order,
        )
        batch["context_length"] = ctx
        return batch, stats

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
            scores.append(core.penalize_missing_eos(raw, gen.ended, cfg.missing_eos_penalty))
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

        Each term of the loss is a mean over the minibatch's N response tokens (over all processes): the loss of a
        micro-batch j with n_j tokens, a mean over those, is weighted by n_j / N, and sum_j (n_j / N) L_j = L. The
        accumulated gradient is the whole minibatch's, up to rounding (and with several processes, the sum over
        them is the global minibatch's)."""
        cfg, ctx = self.cfg, batch["context_length"]
        tokens = batch["mask"][rows].sum()  # N: response tokens in the minibatch
        if self.sum_across is not None:
            tokens = self.sum_across(tokens)
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        nonfinite = False
        for micro in rows.split(self.micro_batch_size):
            qr, am, c, t = core.trim_padding(batch["query_response"][micro], batch["attention_mask"][micro], ctx)
            mask = batch["mask"][micro][:, :t]
            logprobs, values, entropy = self.model(qr, am, c, cfg.temperature, return_entropy=cfg.entropy_coef > 0)
            pg_loss, clipfrac, approxkl = core.policy_loss(
                logprobs, batch["logprobs"][micro][:, :t], batch["advantages"][micro][:, :t], mask, cfg.cliprange
            )
            vf_loss, vf_clipfrac = core.value_loss(
                values, batch["values"][micro][:, :t], batch["returns"][micro][:, :t], mask, cfg.cliprange_value
            )
            loss = pg_loss + cfg.vf_coef * vf_loss
            if cfg.entropy_coef > 0:
                loss = loss - cfg.entropy_coef * core.masked_mean(entropy, mask)  # entropy bonus
            weight = mask.sum() / tokens.clamp(min=1.0)  # n_j / N
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
        try:
            while self.step < self.cfg.steps:
                stats = self.update()
                bar.set_postfix(reward=f"{stats['ppo/score_mean']:.3f}", kl=f"{stats['ppo/kl']:.3f}")
                bar.update(1)
        finally:
            bar.close()
        return self.history

    # ---- saving ------------------------------------------------------------------------------------

    def _value_state(self) -> dict[str, torch.Tensor]:
        module = self.model.value_module()
        if isinstance(module, Critic) and is_peft(module.backbone):
            module = copy.deepcopy(module)
            module.backbone = module.backbone.merge_and_unload()
        return {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}

    def save(self, out_dir: str | os.PathLike | None = None) -> Path:
        """The policy as a plain model dir (LoRA merged) in out_dir (default cfg.out_dir), plus
        `value_head.safetensors` (the value head, or with value_model=separate the whole critic: backbone.*, head.*)."""
        out = _resolve(out_dir if out_dir is not None else self.cfg.out_dir)
        policy = self.policy
        if is_peft(policy):
            policy = copy.deepcopy(policy).merge_and_unload()
        save_plain(policy, self.tokenizer, out)
        save_file(
            self._value_state(), str(out / "value_head.safetensors"), metadata={"value_model": self.cfg.value_model}
        )
        return out


__all__ = ["NonFiniteError", "PPOTrainer"]
