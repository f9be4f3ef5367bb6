"""Stage ppo, the policy-optimisation stage: `align.algorithm` picks the algorithm.

- `ppo` (the default): the project's PPO engine against the reward model (or a programmatic reward named by
  `ppo.reward_fn`), with the frozen SFT model as the KL reference. Every update's statistics go to MLflow under
  `ppo/` (and the shared ones under `align/` too) and to metrics/ppo_history.csv (the DVC plot).
- `grpo`, `rloo`, `dpo`: trl's trainers (rlhflow/training/align.py); every step's statistics go to MLflow under
  `align/` and to metrics/ppo_history.csv, what GRPO and RLOO sampled to an MLflow table (align_completions.json).

Either way the policy is written to `ppo.out_dir` as a plain model dir and registered as `rlhf-policy`, the run and
the version tagged `algorithm=<name>`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlhflow import fsutil
from rlhflow.config.params import Config
from rlhflow.fsutil import atomic_dir, remove_made, write_text_atomic
from rlhflow.fsutil import prepare_checkpoint_dir as keep_or_clear
from rlhflow.training import distributed
from rlhfops.hashing import inputs_fingerprint
from rlhfops.stage_runner import StageContext, cli, stage_task

# A light door: torch, transformers, trl, peft, mlflow and pandas (the models, the PPO engine and trl's trainers, the
# readers, the tracking and registry) are imported inside the functions that use them, so the stage's --help and its
# checks answer before any of them loads.

NAME = "ppo"


def checkpoint_fingerprint(cfg: Config) -> str:
    """What a checkpoint must have been made from to be resumed: the same PPO settings (the run length and memory
    knobs aside), seed, SFT model, reward model and training prompts."""
    from rlhflow.ppo.checkpoints import RESUMABLE_SETTINGS

    files = [
        cfg.path(cfg.sft.out_dir) / "model.safetensors",
        cfg.path(cfg.reward_model.out_dir) / "model.safetensors",
        cfg.path(cfg.validate_.out_dir) / "train.jsonl",
    ]
    settings = cfg.ppo.model_dump(exclude=RESUMABLE_SETTINGS)
    return inputs_fingerprint(files, ppo=settings, seed=cfg.seed)


def prepare_checkpoint_dir(cfg: Config):
    """Keep the checkpoints of an interrupted run with the same inputs (to resume); drop anything else."""

    return fsutil.prepare_checkpoint_dir(
        cfg.path(cfg.ppo.checkpoint_dir), checkpoint_fingerprint(cfg), setting="ppo.checkpoint_dir"
    )


# PPO's statistics that every algorithm logs, under their shared names (rlhflow/training/align.py): the reward source's
# score before the missing-EOS penalty, response length in tokens, the share of responses that ended
PPO_ALIASES = {
    "ppo/score_mean": "align/score_mean",
    "ppo/response_length": "align/completion_length",
    "ppo/eos_fraction": "align/eos_fraction",
}
# summarised over the final quarter of the steps (metrics/ppo.json) for the trl algorithms, where logged
ALIGN_SUMMARY = (
    "align/score_mean",
    "align/reward",
    "align/kl",
    "align/entropy",
    "align/completion_length",
    "align/eos_fraction",
    "align/loss",
    "align/rewards/margins",
    "align/rewards/accuracies",
)


def with_aliases(stats: dict[str, float]) -> dict[str, float]:
    return {**stats, **{alias: stats[key] for key, alias in PPO_ALIASES.items() if key in stats}}


def align_fingerprint(cfg: Config) -> str:
    """What a trl algorithm's Trainer checkpoint must have been made from to be resumed: the same algorithm and
    settings (its own sub-section, the shared ones, PPO's sampling and reward settings), seed, SFT model, reward
    model (GRPO, RLOO), training pairs or prompts and number of processes. The run length counts only with a
    linear learning-rate schedule, which spans it."""

    a = cfg.align
    files = [cfg.path(cfg.sft.out_dir) / "model.safetensors", cfg.path(cfg.validate_.out_dir) / "train.jsonl"]
    sampling = {}
    if a.algorithm in ("grpo", "rloo"):
        if not cfg.ppo.reward_fn:
            files.append(cfg.path(cfg.reward_model.out_dir) / "model.safetensors")
        sampling = cfg.ppo.model_dump(
            include={
                "temperature",
                "top_k",
                "top_p",
                "max_new_tokens",
                "max_prompt_length",
                "stop_strings",
                "missing_eos_penalty",
                "reward_fn",
                "reward_fn_kwargs",
            }
        )
    shared = a.model_dump(
        exclude={"grpo", "rloo", "dpo", "checkpoint_every"} | ({"steps"} if a.lr_schedule == "constant" else set())
    )
    own = getattr(a, a.algorithm).model_dump()
    if a.algorithm == "dpo":
        own["max_prompt_length"] = cfg.ppo.max_prompt_length
    return inputs_fingerprint(
        files, align=shared, algorithm=own, sampling=sampling, seed=cfg.seed, processes=distributed.world_size()
    )


def write_history(path, history: list[dict]) -> None:
    import pandas as pd

    write_text_atomic(path, pd.DataFrame(history).to_csv(index=False))


@dataclass
class TrainedPolicy:
    """What an algorithm's training hands the stage's shared ending (`finish`)."""

    history: list[dict[str, float]]  # one row per step, as metrics/ppo_history.csv holds them
    save: Callable[[Path], None]  # writes the policy into a directory as a plain model dir
    metrics: dict[str, float]  # the stage's summary figures (metrics/ppo.json)
    checkpoint_dir: Path


def run(cfg: Config, ctx: StageContext) -> dict[str, float]:
    """Train with `align.algorithm`, then end as every algorithm does. Training returns None on the other processes
    of a multi-process run: rank 0 holds the same model and writes it."""
    trained = train_ppo(cfg, ctx) if cfg.align.algorithm == "ppo" else train_trl(cfg, ctx)
    return finish(cfg, ctx, trained) if trained is not None else {}


def finish(cfg: Config, ctx: StageContext, trained: TrainedPolicy) -> dict[str, float]:
    """The history written, the policy written whole, the summary logged, the policy registered once all of that
    succeeded, the checkpoints removed."""

    write_history(cfg.path(cfg.metrics_dir) / "ppo_history.csv", trained.history)
    out_dir = cfg.path(cfg.ppo.out_dir)
    with atomic_dir(out_dir, setting="ppo.out_dir") as tmp:
        trained.save(tmp)
    ctx.log_metrics(trained.metrics)
    register_policy(cfg, out_dir, cfg.align.algorithm)
    remove_made(trained.checkpoint_dir)  # logged and registered: nothing left to resume
    return trained.metrics


def register_policy(cfg: Config, out_dir, algorithm: str) -> None:
    """Log and register the policy (once the stage has succeeded); the run and the version say which algorithm made
    it."""
    import mlflow

    from rlhfops import registry, tracking
    from rlhfops.serving.policy import PolicyPyfunc

    mlflow.set_tag("algorithm", algorithm)
    version = registry.log_model_dir(cfg, out_dir, name="policy", wrapper=PolicyPyfunc, registered_name=registry.POLICY)
    if version is not None:
        tracking.client().set_model_version_tag(registry.POLICY, version, "algorithm", algorithm)


def train_trl(cfg: Config, ctx: StageContext) -> TrainedPolicy | None:
    """GRPO, RLOO or DPO with trl (rlhflow/training/align.py), under the same contract as PPO: settings checked before
    any model loads, Trainer checkpoints resumed after a kill, the policy in ppo.out_dir, metrics/ppo_history.csv."""
    import mlflow
    import torch

    from rlhflow.data.readers import read_jsonl
    from rlhflow.models.loading import enable_tf32, load_causal_lm, load_tokenizer, pick_device, save_plain
    from rlhflow.training import align

    algorithm = cfg.align.algorithm
    device = distributed.local_device(pick_device(cfg.device))
    enable_tf32(device)  # fp32 matmuls on Ampere and later GPUs: TF32 tensor cores
    sft_dir = str(cfg.path(cfg.sft.out_dir))
    train_file = cfg.path(cfg.validate_.out_dir) / "train.jsonl"
    if not train_file.exists():
        raise FileNotFoundError(f"{train_file}: no train split; run the validate stage first")
    train_rows = read_jsonl(train_file).to_dict("records")
    tokenizer = load_tokenizer(sft_dir)
    settings = align.AlignSettings(cfg.align, cfg.ppo, cfg.seed)
    align.check_settings(settings, train_rows, tokenizer)  # bad settings fail here, before any model is loaded

    checkpoint_dir = cfg.path(cfg.ppo.checkpoint_dir)
    if ctx.main_process:  # checkpoints of an interrupted run with the same inputs are resumed from; others dropped
        keep_or_clear(checkpoint_dir, align_fingerprint(cfg), setting="ppo.checkpoint_dir")
    distributed.barrier()
    torch.manual_seed(cfg.seed)
    policy = load_causal_lm(sft_dir, pad_token_id=tokenizer.pad_token_id)
    score_fn = ref_model = None
    if algorithm in align.SAMPLING_ALGORITHMS:
        score_fn, _ = reward_source(cfg, device)  # PPO's: the proxy's normalised score, or ppo.reward_fn
    else:  # DPO's reference: the SFT model, frozen
        ref_model = load_causal_lm(sft_dir, pad_token_id=tokenizer.pad_token_id)
    policy, history = align.train_policy(
        settings,
        policy=policy,
        tokenizer=tokenizer,
        train_rows=train_rows,
        work_dir=checkpoint_dir,
        device=device,
        score_fn=score_fn,
        ref_model=ref_model,
        log_fn=lambda stats, step: ctx.log_metrics(stats, step=step),
    )
    if not ctx.main_process:
        return None
    table = align.completions_table(checkpoint_dir, algorithm)
    if table is not None:
        mlflow.log_table(table, artifact_file="align_completions.json")
    return TrainedPolicy(history, lambda tmp: save_plain(policy, tokenizer, tmp), trl_summary(history), checkpoint_dir)


def trl_summary(history: list[dict[str, float]]) -> dict[str, float]:
    """ALIGN_SUMMARY's figures over the final quarter of the steps (where logged), the first score, the steps."""
    last = history[-max(1, len(history) // 4) :]  # the final quarter of the steps, smoothed
    metrics = {}
    for key in ALIGN_SUMMARY:
        values = [h[key] for h in last if key in h and math.isfinite(h[key])]
        if values:
            metrics[f"{key}_final"] = sum(values) / len(values)
    if history and "align/score_mean" in history[0]:
        metrics["align/score_mean_first"] = history[0]["align/score_mean"]
    metrics["align/steps"] = float(len(history))
    return metrics


def train_ppo(cfg: Config, ctx: StageContext) -> TrainedPolicy | None:
    """The project's PPO engine (rlhflow.ppo.trainer), resuming from a checkpoint of the same inputs."""
    import torch

    from rlhflow.ppo.reward_and_critic import in_precision, make_critic
    from rlhflow.ppo.trainer import PPOTrainer

    device, dtype, tokenizer, policy, prompts = load_ppo_inputs(cfg)
    torch.manual_seed(cfg.seed)
    checkpoint_dir = prepare_checkpoint_dir(cfg) if ctx.main_process else cfg.path(cfg.ppo.checkpoint_dir)
    distributed.barrier()  # with several processes: rank 0 has kept or cleared the checkpoints before any reads them
    score_fn, reward_model = reward_source(cfg, device)
    critic = make_critic(cfg.ppo, reward_model, tokenizer)  # from the reward model's fp32 weights
    score_fn = in_precision(score_fn, reward_model, dtype)
    trainer = PPOTrainer(
        cfg.ppo,
        policy=policy,
        tokenizer=tokenizer,
        score_fn=score_fn,
        prompts=prompts,
        device=device,
        seed=cfg.seed,
        checkpoint_dir=checkpoint_dir,
        critic=critic,
        log_fn=lambda stats, step: ctx.log_metrics(with_aliases(stats), step=step),
    )
    if trainer.load_checkpoint():  # an interrupted run of the same inputs left a checkpoint
        print(f"ppo: resuming from the checkpoint of update {trainer.step} in {checkpoint_dir}", flush=True)
        ctx.log_metrics({"ppo/resumed_from_update": float(trainer.step)})
        for step, stats in enumerate(trainer.history, start=1):  # this run's curves start at update 1 too
            ctx.log_metrics(with_aliases(stats), step=step)
    history = trainer.train()
    if not ctx.main_process:
        return None
    rows = [{"step": i + 1, **with_aliases(h)} for i, h in enumerate(history)]
    return TrainedPolicy(rows, trainer.save, ppo_summary(history), checkpoint_dir)


def reward_source(cfg: Config, device):
    """(score_fn, reward model): ppo.reward_fn, or the reward model stage's model (rlhflow.ppo.reward_and_critic)."""
    from rlhflow.ppo.reward_and_critic import load_reward_source

    rm_dir = cfg.path(cfg.reward_model.out_dir)
    return load_reward_source(cfg.ppo, rm_dir, batch_size=cfg.reward_model.eval_batch_size, device=device)


def load_ppo_inputs(cfg: Config):
    """The device and precision, the SFT tokenizer and policy, and the distinct training prompts."""
    from rlhflow.data.readers import read_jsonl
    from rlhflow.models.loading import (
        attn_implementation_for,
        enable_tf32,
        load_causal_lm,
        load_tokenizer,
        pick_device,
        resolve_precision,
    )

    device = distributed.local_device(pick_device(cfg.device))
    dtype = resolve_precision(cfg.ppo.precision, device)  # the trainer resolves the same from cfg.ppo
    enable_tf32(device)  # fp32 matmuls on Ampere and later GPUs: TF32 tensor cores
    print(f"ppo: precision {cfg.ppo.precision} -> {dtype} on {device}", flush=True)
    sft_dir = str(cfg.path(cfg.sft.out_dir))
    tokenizer = load_tokenizer(sft_dir)
    policy = load_causal_lm(
        sft_dir, pad_token_id=tokenizer.pad_token_id, attn_implementation=attn_implementation_for(device, dtype)
    )
    train = read_jsonl(cfg.path(cfg.validate_.out_dir) / "train.jsonl")
    return device, dtype, tokenizer, policy, list(train.drop_duplicates("prompt")["prompt_messages"])


def ppo_summary(history: list[dict[str, float]]) -> dict[str, float]:
    """Score, KL, entropy, length and explained variance over the final quarter of updates; the first score."""
    last = history[-max(1, len(history) // 4) :]  # the final quarter of updates, smoothed
    metrics = {
        f"{k}_final": sum(h[k] for h in last) / len(last)
        for k in ("ppo/score_mean", "ppo/kl", "ppo/entropy", "ppo/response_length", "ppo/explained_variance")
        if k in history[-1]
    }
    metrics["ppo/score_mean_first"] = history[0].get("ppo/score_mean", float("nan"))
    metrics["ppo/updates"] = float(len(history))
    return metrics


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
