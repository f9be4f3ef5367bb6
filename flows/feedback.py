"""One round of human feedback (docs/feedback.md): sample pairs of answers on the feedback split -> send them to Label
Studio -> wait for the labels -> collect them -> retrain from them (validate .. evaluate, as flows.pipeline runs
them). Every step is an MLflow child run of the round's run. Rerun after an interruption, it resends no pair and
loses no label: pairs and labels are appended by id.

    python -m flows.feedback [--wait-minutes 60] [--no-retrain] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import sys
import time

from prefect import flow

from flows.pipeline import run_pipeline, with_overrides
from rlhflow.config.params import Config, parse_config_args
from rlhflow.data.feedback import FeedbackError
from rlhfops import tracking
from rlhfops.labeling import LabelingError
from rlhfops.temporary_server import start_temporary_server
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


def main(argv: list[str] | None = None) -> None:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--no-sample", action="store_true", help="send and collect the pairs already sampled")
    own.add_argument("--wait-minutes", type=float, default=0.0, help="how long to wait for every label")
    own.add_argument("--poll-seconds", type=float, default=30.0, help="how often to collect while waiting")
    own.add_argument("--partial", action="store_true", help="retrain even when some pairs wait for a label")
    own.add_argument("--no-retrain", action="store_true", help="stop after collecting the labels")
    description = "One round of human feedback: sample, send, wait for and collect labels, retrain (docs/feedback.md)."
    cfg, args = parse_config_args(argv, description, parents=(own,))
    start_temporary_server()
    try:
        feedback_round(
            config=cfg,
            sample=not args.no_sample,
            wait_minutes=args.wait_minutes,
            poll_seconds=args.poll_seconds,
            partial=args.partial,
            retrain=not args.no_retrain,
        )
    except (FeedbackError, LabelingError) as err:  # a clear message, not a traceback
        sys.exit(f"\nfeedback round stopped: {err}")


if __name__ == "__main__":
    main(sys.argv[1:])
