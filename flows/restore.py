"""Put a pipeline run's data, models and metrics back into the workspace:

    python -m flows.restore RUN_ID [--remote NAME] [--params params.yaml] [--set tracking.tracking_uri=...]

RUN_ID is an MLflow parent run of the pipeline flow: its artifact `dvc.lock` becomes the stages' entries in
dvc.lock, and what the DVC cache lacks is pulled from the remote (--remote, else DVC's default). Nothing is written
unless every recorded path is one its stage writes, inside the workspace, and every object holds its recorded md5
(rlhfops/restore.py; docs/lineage.md). Exits 1 when anything differs or cannot be restored. The Prefect deployment
`restore-run/restore` runs the same flow.
"""

from __future__ import annotations

# A light door: prefect, mlflow and dvc load with the flow (flows/restore_flow.py), after --help has answered.
import argparse
import sys

from flows import flow_exit_status, handed_on
from rlhflow.config.params import parse_config_args

__getattr__ = handed_on(__name__, "flows.restore_flow")


def main(argv: list[str] | None = None) -> int:
    """The command line (its exit status); the flow, Prefect, MLflow and DVC are loaded once it is parsed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):  # `RUN_ID --help` lists the params options
        print(__doc__.strip())
        return 0
    if not argv or argv[0].startswith("-"):
        print(__doc__.strip(), file=sys.stderr)
        return 2

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--remote", default=None, help="DVC remote to pull from (default: DVC's default remote)")
    known, rest = pre.parse_known_args(argv[1:])
    cfg, _ = parse_config_args(rest, "Restore a pipeline run's outputs (the tracking store is read from params).")
    from flows.restore_flow import restore_run
    from rlhfops.restore import RestoreError
    from rlhfops.tracking import stored_config

    return flow_exit_status(
        lambda: restore_run(argv[0], known.remote, stored_config(cfg)), RestoreError, "restore failed"
    )


if __name__ == "__main__":
    sys.exit(main())
