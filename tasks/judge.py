"""Stage judge: train the judge, a second Bradley-Terry reward model, on the judge split: prompts disjoint from
the ones the proxy reward model and PPO train on. PPO never optimises against it, so evaluate's judge win rate is
a second opinion that reward hacking of the proxy does not inflate. Its accuracy on the test pairs goes to the
stage run and the parent run; it is registered as `rlhf-judge`."""

from __future__ import annotations

from rlhflow.config import Config
from tasks._common import StageContext, cli, stage_task
from tasks.reward_model import train_pairwise_model

NAME = "judge"
REGISTERED_NAME = "rlhf-judge"


def run(cfg: Config, ctx: StageContext) -> dict[str, float]:
    # another seed than the proxy's: a different score-head initialisation and data order as well as other data
    metrics = train_pairwise_model(
        cfg, ctx, cfg.judge, split="judge", prefix="judge", registered_name=REGISTERED_NAME, seed=cfg.seed + 1
    )
    ctx.log_metrics({k: v for k, v in metrics.items() if k in ("judge/accuracy", "judge/accuracy_se")}, on_parent=True)
    return metrics


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
