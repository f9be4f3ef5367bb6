"""One round of human feedback (docs/feedback.md): sample pairs of answers on the feedback split -> send them to Label
Studio -> wait for the labels -> collect them -> retrain from them (validate .. evaluate, as flows.pipeline runs
them). Every step is an MLflow child run of the round's run. Rerun after an interruption, it resends no pair and
loses no label: pairs and labels are appended by id.

    python -m flows.feedback [--wait-minutes 60] [--no-retrain] [--set key=value ...]
"""

from __future__ import annotations

# A light door: prefect, mlflow, pandas and torch load with the flow (flows/feedback_flow.py), after --help answers.
import argparse
import sys

from flows import handed_on
from rlhflow.config.params import parse_config_args
from rlhfops.labeling import LabelingError
from rlhfops.temporary_server import start_temporary_server

__getattr__ = handed_on(__name__, "flows.feedback_flow")


def main(argv: list[str] | None = None) -> None:
    """The command line; the flow, Prefect, MLflow and the policy's stack are loaded once it is parsed."""
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--no-sample", action="store_true", help="send and collect the pairs already sampled")
    own.add_argument("--wait-minutes", type=float, default=0.0, help="how long to wait for every label")
    own.add_argument("--poll-seconds", type=float, default=30.0, help="how often to collect while waiting")
    own.add_argument("--partial", action="store_true", help="retrain even when some pairs wait for a label")
    own.add_argument("--no-retrain", action="store_true", help="stop after collecting the labels")
    description = "One round of human feedback: sample, send, wait for and collect labels, retrain (docs/feedback.md)."
    cfg, args = parse_config_args(argv, description, parents=(own,))
    from flows.feedback_flow import feedback_round
    from rlhflow.data.feedback import FeedbackError
    from rlhfops.tracking import stored_config

    start_temporary_server()
    try:
        feedback_round(
            config=stored_config(cfg),
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
