"""Stage ppo: PPO fine-tuning of the SFT policy against the reward model (or a programmatic reward named by
`ppo.reward_fn`), with the frozen SFT model as the KL reference. Every update's statistics go to MLflow under
`ppo/` and to metrics/ppo_history.csv (the DVC plot); the final policy is registered as `rlhf-policy`."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

from rlhflow.config import Config
from tasks._common import StageContext, cli, stage_task

NAME = "ppo"
REGISTERED_NAME = "rlhf-policy"


def load_reward_fn(spec: str, kwargs: dict | None = None) -> Callable:
    """`package.module:function`, called as fn(prompt_messages_batch, responses, **kwargs) -> sequence of floats."""
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"ppo.reward_fn {spec!r} must look like 'package.module:function'")
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise ValueError(f"ppo.reward_fn {spec!r}: {attr!r} is not a callable in {module_name}")
    return functools.partial(fn, **(kwargs or {}))


def load_reward_source(cfg: Config, device):
    """(score_fn, reward model): ppo.reward_fn when set (no reward model), else the trained reward model's
    normalised score."""
    import torch

    if cfg.ppo.reward_fn:
        fn = load_reward_fn(cfg.ppo.reward_fn, cfg.ppo.reward_fn_kwargs)
        return lambda prompts, responses: torch.as_tensor(list(fn(prompts, responses)), dtype=torch.float32), None
    from rlhflow.reward import RewardModel

    rm = RewardModel.load(
        cfg.path(cfg.reward_model.out_dir), batch_size=cfg.reward_model.eval_batch_size, device=device
    )
    return rm.score, rm


def make_critic(cfg: Config, reward_model, policy_tokenizer):
    """The separate critic's start (ppo.critic_init): a copy of the reward model when it reads the policy's tokens,
    else None (the trainer copies the SFT backbone)."""
    from rlhflow.policy import Critic

    if cfg.ppo.value_model != "separate" or cfg.ppo.critic_init == "sft":
        return None
    if reward_model is None:
        why_not = "ppo.reward_fn replaces the reward model"
    elif reward_model.tokenizer.get_vocab() != policy_tokenizer.get_vocab():
        why_not = "the reward model's tokenizer is not the policy's"
    else:
        try:
            critic = Critic.from_reward_model(reward_model.model, reward_model.mean, reward_model.std)
            print("ppo: the critic starts from the reward model", flush=True)
            return critic
        except ValueError as err:
            why_not = str(err)
    if cfg.ppo.critic_init == "reward_model":
        raise ValueError(f"ppo.critic_init=reward_model: {why_not}")
    print(f"ppo: the critic starts from the SFT model ({why_not})", flush=True)
    return None


def inputs_fingerprint(cfg: Config) -> str:
    """What a checkpoint must have been made from to be resumed: the same PPO settings (the run length aside),
    seed, SFT model, reward model and training prompts."""
    import json

    from rlhflow.fsutil import file_stamps

    files = [
        cfg.path(cfg.sft.out_dir) / "model.safetensors",
        cfg.path(cfg.reward_model.out_dir) / "model.safetensors",
        cfg.path(cfg.validate_.out_dir) / "train.jsonl",
    ]
    settings = cfg.ppo.model_dump(exclude={"steps", "checkpoint_every", "checkpoint_dir", "out_dir"})
    return json.dumps({"ppo": settings, "seed": cfg.seed, "inputs": file_stamps(files)}, sort_keys=True)


def prepare_checkpoint_dir(cfg: Config):
    """Keep the checkpoints of an interrupted run with the same inputs (to resume); drop anything else."""
    from rlhflow import fsutil

    return fsutil.prepare_checkpoint_dir(cfg.path(cfg.ppo.checkpoint_dir), inputs_fingerprint(cfg))


def write_history(path, history: list[dict]) -> None:
    import pandas as pd

    from rlhflow.fsutil import write_text_atomic

    write_text_atomic(path, pd.DataFrame(history).to_csv(index=False))


def run(cfg: Config, ctx: StageContext) -> dict[str, float]:
    import shutil

    import torch

    from rlhflow import distributed, tracking
    from rlhflow.data.formats import read_jsonl
    from rlhflow.fsutil import atomic_dir
    from rlhflow.models import load_causal_lm, load_tokenizer, pick_device
    from rlhflow.ppo.trainer import PPOTrainer

    device = distributed.local_device(pick_device(cfg.device))
    sft_dir = str(cfg.path(cfg.sft.out_dir))
    tokenizer = load_tokenizer(sft_dir)
    policy = load_causal_lm(sft_dir, pad_token_id=tokenizer.pad_token_id)
    train = read_jsonl(cfg.path(cfg.validate_.out_dir) / "train.jsonl")
    prompts = list(train.drop_duplicates("prompt")["prompt_messages"])

    torch.manual_seed(cfg.seed)
    checkpoint_dir = prepare_checkpoint_dir(cfg) if ctx.main_process else cfg.path(cfg.ppo.checkpoint_dir)
    distributed.barrier()  # with several processes: rank 0 has kept or cleared the checkpoints before any reads them
    score_fn, reward_model = load_reward_source(cfg, device)
    trainer = PPOTrainer(
        cfg.ppo,
        policy=policy,
        tokenizer=tokenizer,
        score_fn=score_fn,
        prompts=prompts,
        device=device,
        seed=cfg.seed,
        checkpoint_dir=checkpoint_dir,
        critic=make_critic(cfg, reward_model, tokenizer),
        log_fn=lambda stats, step: ctx.log_metrics(stats, step=step),
    )
    if trainer.load_checkpoint():  # an interrupted run of the same inputs left a checkpoint
        print(f"ppo: resuming from the checkpoint of update {trainer.step} in {checkpoint_dir}", flush=True)
        ctx.log_metrics({"ppo/resumed_from_update": float(trainer.step)})
        for step, stats in enumerate(trainer.history, start=1):  # this run's curves start at update 1 too
            ctx.log_metrics(stats, step=step)
    history = trainer.train()
    if not ctx.main_process:  # another process of a multi-process run: rank 0 holds the same model and writes it
        return {}
    write_history(cfg.path(cfg.metrics_dir) / "ppo_history.csv", [{"step": i + 1, **h} for i, h in enumerate(history)])

    out_dir = cfg.path(cfg.ppo.out_dir)
    with atomic_dir(out_dir) as tmp:
        trainer.save(tmp)
    shutil.rmtree(checkpoint_dir, ignore_errors=True)  # finished: nothing left to resume
    last = history[-max(1, len(history) // 4) :]  # the final quarter of updates, smoothed
    metrics = {
        f"{k}_final": sum(h[k] for h in last) / len(last)
        for k in ("ppo/score_mean", "ppo/kl", "ppo/entropy", "ppo/response_length")
        if k in history[-1]
    }
    metrics["ppo/score_mean_first"] = history[0].get("ppo/score_mean", float("nan"))
    metrics["ppo/updates"] = float(len(history))
    ctx.log_metrics(metrics)
    tracking.log_model_dir(cfg, out_dir, name="policy", kind="policy", registered_name=REGISTERED_NAME)
    return metrics


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
