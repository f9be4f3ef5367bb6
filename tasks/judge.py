"""Stage judge: train the judge, a second Bradley-Terry reward model, on the judge split: conversations disjoint from
the ones the proxy reward model and PPO train on. PPO never optimises against it, so evaluate's judge win rate is
a second opinion that reward hacking of the proxy does not inflate. Its accuracy on the test pairs goes to the
stage run and the parent run; it is registered as `rlhf-judge`."""

from __future__ import annotations

from rlhflow.config import Config
from rlhfops import registry
from rlhfops.stage_runner import StageContext, cli, stage_task

NAME = "judge"
REGISTERED_NAME = registry.JUDGE


def run(cfg: Config, ctx: StageContext) -> dict[str, float]:
    from rlhflow.reward_model import LENGTH_AWARE_METRICS
    from tasks.pairwise_training import train_pairwise_model

    # its own seed, not the training seed: runs of a seed sweep are judged by the same model
    metrics = train_pairwise_model(
        cfg,
        ctx,
        cfg.judge,
        split="judge",
        prefix="judge",
        model_name=NAME,
        registered_name=REGISTERED_NAME,
        seed=cfg.judge.seed,
    )
    on_parent = {"judge/accuracy", "judge/accuracy_se"} | {f"judge/{k}" for k in LENGTH_AWARE_METRICS}
    ctx.log_metrics({k: v for k, v in metrics.items() if k in on_parent}, on_parent=True)
    return metrics


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
