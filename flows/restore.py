"""Put a pipeline run's data, models and metrics back into the workspace:

    python -m flows.restore RUN_ID [--params params.yaml] [--set tracking.tracking_uri=...]

RUN_ID is an MLflow parent run of the pipeline flow. Its artifact `dvc.lock` becomes the stages' entries in
the repository's dvc.lock, DVC checks the cached outputs out (from the local cache, else pulled from the default
remote), the metrics and plot data come from the run's artifacts, and each output's md5 is checked against the
run's record (rlhflow/lineage.py). Exits 1 when any output differs or cannot be restored.
"""

from __future__ import annotations

import sys

from rlhflow import lineage
from rlhflow.config import parse_config_args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    run_id, rest = argv[0], argv[1:]
    cfg, _ = parse_config_args(rest, "Restore a pipeline run's outputs (the tracking store is read from params).")
    try:
        restored = lineage.restore(run_id, cfg)
    except lineage.RestoreError as err:
        print(f"restore failed: {err}", file=sys.stderr)
        return 1
    for r in restored:
        print(f"{'ok      ' if r.ok else 'MISMATCH'} {r.stage:14s} {r.path}  {r.md5}  ({r.source})")
    bad = [r for r in restored if not r.ok]
    if bad:
        print(f"{len(bad)} output(s) differ from run {run_id}'s record", file=sys.stderr)
        return 1
    print(f"restored {len(restored)} output(s) of run {run_id}; dvc.lock holds its entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
