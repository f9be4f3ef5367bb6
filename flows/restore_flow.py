"""The restore's Prefect flow, `restore_run`: what `python -m flows.restore RUN_ID` runs once its command line is
parsed (flows/restore.py, the command, hands these names on), and what the deployment `restore-run/restore` runs.
What is restored and checked: flows/restore.py's docstring, rlhfops/restore.py and docs/lineage.md.
"""

from __future__ import annotations

from prefect import flow

from rlhflow.config.params import Config, load_config
from rlhfops import prefect_replies, restore

# every reply of the Prefect server read within bounds of size and time (rlhfops/prefect_replies.py)
prefect_replies.bound_prefect_replies()


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
