"""The pipeline across a Prefect work pool: each stage runs on whichever worker takes it from its queue (accelerator
stages on HEAVY_QUEUE, demo_data and validate on LIGHT_QUEUE), in that worker's own clone, with its inputs pulled
from the DVC remote by md5 and its outputs pushed back; the dispatcher holds the MLflow parent run, which ends with
the same restorable artifacts as a run of flows/pipeline.py. One training slot per worker.

    python -m flows.team deploy                  # the work pool and deployments, on the server in $PREFECT_API_URL
    python -m flows.team run [--stages a,b] [--set KEY=VALUE]
                                                 # start a pipeline run through the API and wait for it

How a run goes, and its faults: docs/scaling.md, A team's stack.
"""

from __future__ import annotations

# A light door: prefect, mlflow, dvc and torch load with the flows (flows/team_flow.py), after --help has answered.
import argparse
import sys

from flows import add_stages_option, handed_on
from rlhflow.config.params import parse_config_args
from rlhfops.stages import STAGE_NAMES

__getattr__ = handed_on(__name__, "flows.team_flow")


def main(argv: list[str] | None = None) -> int:
    """The command line (its exit status); the flows, Prefect and MLflow are loaded once it is parsed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):  # `run --help` lists the params options
        print(__doc__.strip())
        return 0
    if not argv or argv[0] not in ("deploy", "run"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    if argv[0] == "deploy":
        from flows.team_flow import POOL, deploy

        for name in deploy():
            print(f"deployment {name} (work pool {POOL}, its job template restricted)")
        return 0
    subset = argparse.ArgumentParser(add_help=False)
    add_stages_option(subset)
    _, args = parse_config_args(
        argv[1:], "Start a team pipeline run through the Prefect API and wait for it.", parents=(subset,)
    )
    stages = args.stages.split(",") if args.stages else None
    unknown = [name for name in stages or [] if name not in STAGE_NAMES]
    if unknown:
        print(
            f"error: --stages: unknown stage(s) {', '.join(unknown)}; stages: {', '.join(STAGE_NAMES)}", file=sys.stderr
        )
        return 2
    from flows.team_flow import start_run

    run = start_run(list(args.overrides or []), stages)  # the dispatcher reads params.yaml in its clone, then these
    print(f"flow run {run.name}: {run.state.name} {run.state.message or ''}")
    return 0 if run.state.is_completed() else 1


if __name__ == "__main__":
    sys.exit(main())
