"""Put a pipeline run's data, models and metrics back into the workspace:

    python -m flows.restore RUN_ID [--remote NAME] [--params params.yaml] [--set tracking.tracking_uri=...]

RUN_ID is an MLflow parent run of the pipeline flow: its artifact `dvc.lock` becomes the stages' entries in
dvc.lock, and what the DVC cache lacks is pulled from the remote (--remote, else DVC's default). Nothing is written
unless every recorded path is one its stage writes, inside the workspace, and every object holds its recorded md5
(rlhfops/restore.py; docs/lineage.md). Exits 1 when anything differs or cannot be restored. The Prefect deployment
`restore-run/restore` runs the same flow.
"""

from __future__ import annotations

import argparse
import sys

from prefect import flow

from rlhflow.config.params import Config, load_config, parse_config_args
from rlhfops import restore
from rlhfops.temporary_server import start_temporary_server


@flow(name="restore-run", log_prints=True)
def restore_run(run_id: str, remote: str | None = None, config: Config | None = None) -> list[dict]:
    """Put an MLflow parent run's data, models and metrics back into the workspace.

    Args:
        run_id: the pipeline's MLflow parent run
        remote: the DVC remote to pull missing objects from; empty: DVC's default remote
        config: params (the tracking store is read from them); empty: params.yaml
    """
    restored = restore.restore(run_id, config or load_config(), remote)
    for r in restored:
        print(f"{'ok      ' if r.ok else 'MISMATCH'} {r.stage:14s} {r.path}  {r.md5}  ({r.source})")
    bad = [r.path for r in restored if not r.ok]
    if bad:
        raise restore.RestoreError(f"{len(bad)} output(s) differ from run {run_id}'s record: {bad}")
    print(f"restored {len(restored)} output(s) of run {run_id}; dvc.lock holds its entries")
    return [vars(r) for r in restored]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print(__doc__.strip(), file=sys.stderr)
        return 2

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--remote", default=None, help="DVC remote to pull from (default: DVC's default remote)")
    known, rest = pre.parse_known_args(argv[1:])
    cfg, _ = parse_config_args(rest, "Restore a pipeline run's outputs (the tracking store is read from params).")
    try:
        start_temporary_server()
        restore_run(argv[0], known.remote, cfg)
    except restore.RestoreError as err:
        print(f"restore failed: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
