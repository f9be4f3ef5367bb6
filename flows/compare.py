"""Two finished pipeline runs' policies head to head on the test prompts:

    python -m flows.compare RUN_A RUN_B [--params params.yaml] [--set KEY=VALUE]

RUN_A and RUN_B are MLflow parent runs of the pipeline flow that registered a policy. Both policies answer the test
prompts as their evaluation sampled them, and the judge both runs were measured with decides each pair: A's win rate
over B, where both answers ended and length-controlled, with 95% intervals. Refused, naming why, unless both were
measured on the same test split by the same judge and this workspace holds them (`python -m flows.restore RUN_A`
puts a run's back). The result is an MLflow run of its own, linked from both runs (tag `compare.with.<other>`).
Exits 1 when the runs cannot be compared. The Prefect deployment `compare-runs/compare` runs the same flow.
"""

from __future__ import annotations

# A light door: prefect, mlflow and torch load with the flow (flows/compare_flow.py), after --help has answered.
import sys

from flows import flow_exit_status, handed_on
from rlhflow.config.params import parse_config_args

__getattr__ = handed_on(__name__, "flows.compare_flow")


def main(argv: list[str] | None = None) -> int:
    """The command line (its exit status); the flow, Prefect, MLflow and the models load once it is parsed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if len(argv) < 2 or any(a.startswith("-") for a in argv[:2]):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    cfg, _ = parse_config_args(argv[2:], "Compare two pipeline runs' policies head to head.")
    from flows.compare_flow import compare_runs
    from rlhfops.tracking import stored_config
    from tasks.head_to_head import ComparisonError

    return flow_exit_status(
        lambda: compare_runs(argv[0], argv[1], stored_config(cfg)), ComparisonError, "head to head refused"
    )


if __name__ == "__main__":
    sys.exit(main())
