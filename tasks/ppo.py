"""Stage ppo: PPO fine-tuning of the SFT policy against the reward model (or a programmatic reward named by
`ppo.reward_fn`), with the frozen SFT model as the KL reference. Every update's statistics go to MLflow under
`ppo/` and to metrics/ppo_history.csv (the DVC plot); the final policy is registered as `rlhf-policy`."""

from __future__ import annotations

# Heavy imports (torch, transformers, mlflow, the library's model code) are deferred into the stage body, so
# that importing the module (the flow does, to get its task; so does `--help`) stays fast.
from rlhflow import registered_models
from rlhflow.config import Config
from tasks._common import StageContext, cli, stage_task

NAME = "ppo"
REGISTERED_NAME = registered_models.POLICY


def checkpoint_fingerprint(cfg: Config) -> str:
    """What a checkpoint must have been made from to be resumed: the same PPO settings (the run length aside),
    seed, SFT model, reward model and training prompts."""
    from rlhflow.hashing import inputs_fingerprint

    files = [
        cfg.path(cfg.sft.out_dir) / "model.safetensors",
        cfg.path(cfg.reward_model.out_dir) / "model.safetensors",
        cfg.path(cfg.validate_.out_dir) / "train.jsonl",
    ]
    settings = cfg.ppo.model_dump(exclude={"steps", "checkpoint_every", "checkpoint_dir", "out_dir"})
    return inputs_fingerprint(files, ppo=settings, seed=cfg.seed)


def prepare_checkpoint_dir(cfg: Config):
    """Keep the checkpoints of an interrupted run with the same inputs (to resume); drop anything else."""
    from rlhflow import fsutil

    return fsutil.prepare_checkpoint_dir(cfg.path(cfg.ppo.checkpoint_dir), checkpoint_fingerprint(cfg))


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
    from rlhflow.ppo.setup import load_reward_source, make_critic
    from rlhflow.ppo.trainer import PPOTrainer
    from rlhflow.serving.policy import PolicyPyfunc

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
    tracking.log_model_dir(cfg, out_dir, name="policy", wrapper=PolicyPyfunc, registered_name=REGISTERED_NAME)
    return metrics


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
