"""The feedback round's Prefect flow, `feedback_round`: what `python -m flows.feedback` runs once its command line is
parsed (flows/feedback.py, the command, hands these names on). The round, step by step: flows/feedback.py's
docstring and docs/feedback.md.
"""

from __future__ import annotations

import time

from prefect import flow

from flows.pipeline_flow import run_pipeline, with_overrides
from rlhflow.config.params import Config
from rlhflow.data.feedback import FeedbackError
from rlhfops import tracking
from tasks.feedback import feedback_task

RETRAIN = ["validate", "reward_model", "judge", "sft_answers", "ppo", "evaluate"]


def wait_for_labels(cfg: Config, parent: str, wait_minutes: float, poll_seconds: float) -> dict[str, float]:
    """Collect until no sent pair waits for a label, or `wait_minutes` have passed; the last collect's metrics."""
    deadline = time.monotonic() + wait_minutes * 60
    while True:
        metrics = feedback_task.with_options(name="feedback_collect")("collect", cfg, parent)
        waiting = int(metrics["feedback/pairs_waiting"])
        if not waiting or time.monotonic() >= deadline:
            return metrics
        print(f"feedback: {waiting} pair(s) wait for a label; collecting again in {poll_seconds:.0f} s")
        time.sleep(poll_seconds)


@flow(name="rlhf-feedback-round", log_prints=True)
def feedback_round(
    config: Config | None = None,
    overrides: list[str] | None = None,
    sample: bool = True,
    wait_minutes: float = 0.0,
    poll_seconds: float = 30.0,
    partial: bool = False,
    retrain: bool = True,
) -> dict[str, float]:
    """A feedback round: sample, send, wait for and collect labels, retrain.

    Args:
        config: every hyperparameter (params.yaml; its values are the defaults)
        overrides: params.yaml overrides, e.g. ["feedback.n_pairs=64"]
        sample: sample new pairs from the current policy first (off: send and collect the pairs already sampled)
        wait_minutes: how long to wait for the people to label every pair sent
        poll_seconds: how often to collect while waiting
        partial: retrain even when some pairs still wait for a label (off: the round stops, to be rerun)
        retrain: after collecting, run validate .. evaluate on the labels
    """
    cfg = with_overrides(config, overrides)
    tracking.preflight(cfg)
    with tracking.start_run(cfg, name="feedback_round", params={}, tags={"stage": "feedback_round"}) as parent:
        run_id = parent.info.run_id
        if sample:
            feedback_task.with_options(name="feedback_sample")("sample", cfg, run_id)
        feedback_task.with_options(name="feedback_send")("send", cfg, run_id)
        metrics = wait_for_labels(cfg, run_id, wait_minutes, poll_seconds)
        waiting = int(metrics["feedback/pairs_waiting"])
        if waiting and not partial:  # the round's run ends FAILED, with this message as its error tag
            raise FeedbackError(
                f"{waiting} pair(s) still wait for a label in Label Studio project {cfg.feedback.project!r}: rerun "
                "the round when they are labelled (no pair is sent twice, no label is lost), or pass --partial"
            )
        if retrain:
            metrics |= run_pipeline(cfg, RETRAIN, parent_run=run_id)
    return metrics
