"""Stage sft_answers: the SFT model's answers to the evaluation prompts (one per test conversation), sampled once
with the evaluation's settings, classified (ended / cut / degenerate) and scored by the proxy and the judge. Every
evaluate of a policy, and every point of a sweep, compares against these same answers: they change only with the
SFT model, the test split, the sampling settings, the proxy or the judge (rlhflow/evaluation/held_out.py)."""

from __future__ import annotations

from rlhflow.config.params import Config
from rlhfops.stage_runner import StageContext, cli, stage_task

NAME = "sft_answers"


def run(cfg: Config, ctx: StageContext) -> dict[str, float]:
    from rlhflow.evaluation.held_out import sample_reference
    from rlhflow.fsutil import atomic_dir
    from tasks.evaluation_setup import evaluation_setup

    setup = evaluation_setup(cfg)
    with atomic_dir(setup.reference_dir, setting="evaluate.reference_dir") as tmp:
        metrics = sample_reference(setup, tmp)
    ctx.log_metrics(metrics)
    return metrics


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
