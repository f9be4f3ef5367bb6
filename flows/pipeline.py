"""The full RLHF pipeline as one Prefect flow: the stages of rlhfops.stages.STAGES, in order, inside one MLflow
parent run (one child run per stage that runs). `python -m flows.pipeline [--params FILE] [--set KEY=VALUE ...]
[--stages ppo,evaluate] [--force]`, or from the Prefect UI (`make ui`). A failing stage fails the flow and stops
everything downstream.

A stage DVC finds unchanged is skipped and reports its recorded metrics; one that ran is committed as `dvc repro`
commits it (rlhfops/stage_lock.py). The parent run is restorable (flows/restore.py). One run at a time per workspace,
and accelerator stages hold a training slot. The whole behaviour: docs/prefect.md; lineage: docs/lineage.md.
"""

from __future__ import annotations

# A light door: prefect, mlflow, dvc and torch load with the flow (flows/pipeline_flow.py), after --help has answered.
import argparse
import sys
import time

from flows import add_stages_option, handed_on
from rlhflow.config.params import parse_config_args
from rlhfops.stages import STAGE_NAMES
from rlhfops.temporary_server import start_temporary_server
from rlhfops.training_slot import TRAINING_LIMIT, reset_server_limit

__getattr__ = handed_on(__name__, "flows.pipeline_flow")


def main(argv: list[str] | None = None) -> None:
    """The command line; the flow, Prefect and MLflow are loaded once it is parsed."""
    pre = argparse.ArgumentParser(add_help=False)
    add_stages_option(pre)
    pre.add_argument("--force", action="store_true", help="run every stage even when it is up to date")
    pre.add_argument("--push", action="store_true", help="push the run's data and models to a DVC remote after it")
    pre.add_argument("--remote", default=None, help="the DVC remote for --push (default: DVC's default remote)")
    pre.add_argument(
        "--reset-training-limit",
        action="store_true",
        help=f"only mark every slot of the Prefect server's concurrency limit {TRAINING_LIMIT!r} free (a run "
        "killed before its lease expired left one taken) and exit",
    )
    known, _ = pre.parse_known_args(argv)
    if known.reset_training_limit:  # before the config is read: it needs none
        before, after = reset_server_limit(TRAINING_LIMIT)
        print(f"{TRAINING_LIMIT}: {before} slot(s) taken before, {after} now")
        return
    cfg, args = parse_config_args(
        argv,
        f"Run the RLHF pipeline flow ({' -> '.join(STAGE_NAMES)}); "
        "--stages a,b runs a subset, --force runs stages that are up to date too.",
        parents=(pre,),
    )
    from flows.pipeline_flow import rlhf_pipeline
    from rlhfops.tracking import stored_config

    start = time.perf_counter()
    start_temporary_server()
    stages = args.stages.split(",") if args.stages else None
    rlhf_pipeline(config=stored_config(cfg), stages=stages, force=args.force, push=args.push, remote=args.remote)
    print(f"{'total wall time':44s} {time.perf_counter() - start:9.1f}s")


if __name__ == "__main__":
    main(sys.argv[1:])
