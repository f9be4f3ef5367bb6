"""The head to head's Prefect flow, `compare_runs`: what `python -m flows.compare RUN_A RUN_B` runs once its command
line is parsed (flows/compare.py hands these names on), and what the deployment `compare-runs/compare` runs. What
is compared and when it is refused: tasks/head_to_head.py and docs/mlflow.md.
"""

from __future__ import annotations

from prefect import flow

from rlhflow.config.params import Config, load_config
from rlhflow.progress import ProgressLines
from rlhfops import prefect_replies
from tasks import head_to_head

# every reply of the Prefect server read within bounds of size and time (rlhfops/prefect_replies.py)
prefect_replies.bound_prefect_replies()


@flow(name="compare-runs", log_prints=True)
def compare_runs(run_a: str, run_b: str, config: Config | None = None) -> dict[str, float]:
    """Two finished pipeline runs' policies head to head on the test prompts, by the judge both were measured with.

    Args:
        run_a: a pipeline's MLflow parent run (policy A)
        run_b: another one (policy B)
        config: params (the tracking store, the evaluation's settings); empty: params.yaml
    """
    metrics = head_to_head.compare_runs(config or load_config(), run_a, run_b, lines=ProgressLines("compare"))
    print(head_to_head.description(run_a, run_b, metrics))
    return metrics
