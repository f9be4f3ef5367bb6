"""Two finished pipeline runs' policies head to head on the test prompts, judged as the evaluation judges a policy
against the SFT model: A's win rate over B overall, where both answers ended and length-controlled, with 95%
intervals; logged as an MLflow run of its own that both runs link to.

A figure is comparable only with one measured on the same data by the same judge: the runs' registered policies must
carry the same test split and judge (their `basis.*` tags, set by the evaluate stage), and this workspace must hold
that split and judge (else `python -m flows.restore RUN_A` puts them back). Each policy answers on the random streams
its own evaluation used, so its answers are the ones its run's report shows wherever the settings are the same.
Command: flows/compare.py; docs/mlflow.md.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from rlhflow.config.params import Config

# A light door: mlflow, torch and the project's evaluation are imported inside the functions that use them, so
# `python -m flows.compare --help` and the Prefect deployments answer before any of them loads.

COMPARED_TAG = "compare.with"  # on each compared run: the comparison run's id per other run
BASIS_KEYS = ("test_split_md5", "judge_md5")  # what both runs' figures and this workspace must share


class ComparisonError(RuntimeError):
    """The two runs cannot be compared (not finished pipeline runs, no registered policy, another split or judge)."""


def policy_version(client, run_id: str) -> str:
    """The version of `rlhf-policy` that the finished pipeline run `run_id` registered."""
    from mlflow.exceptions import MlflowException

    from rlhfops import registry, tracking

    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise ComparisonError(f"run {run_id}: no such run in the tracking store") from None
    if run.data.tags.get("pipeline") != "rlhf" or run.info.status != "FINISHED":
        raise ComparisonError(f"run {run_id} is not a finished pipeline run (status {run.info.status})")
    registered = run.data.tags.get(tracking.REGISTERED_MODELS_TAG, "").split(", ")
    versions = [entry.split("/", 1)[1] for entry in registered if entry.startswith(f"{registry.POLICY}/")]
    if not versions:
        raise ComparisonError(
            f"run {run_id} registered no policy (tracking.register_models off, or its ppo stage was skipped): "
            "compare runs that trained one"
        )
    return versions[-1]


def check_basis(client, run_ids: list[str], versions: list[str], workspace: dict[str, str]) -> None:
    """Both policies measured on the same test split by the same judge, and this workspace holding those."""
    from rlhfops import promotion, registry

    bases = [promotion.evaluation_basis(client, registry.POLICY, version) for version in versions]
    for run_id, version, basis in zip(run_ids, versions, bases):
        if not all(key in basis for key in BASIS_KEYS):
            raise ComparisonError(f"run {run_id}'s policy (version {version}) was never evaluated: no basis tags")
    differ = [key for key in BASIS_KEYS if bases[0][key] != bases[1][key]]
    if differ:
        raise ComparisonError(
            f"runs {run_ids[0]} and {run_ids[1]} were measured on different {' and '.join(differ)}: a figure is "
            "comparable only with one measured on the same data by the same judge"
        )
    differ = [key for key in BASIS_KEYS if workspace.get(key) != bases[0][key]]
    if differ:
        raise ComparisonError(
            f"this workspace's {' and '.join(differ)} is not the one runs {run_ids[0]} and {run_ids[1]} were measured "
            f"with: put one of them back first (python -m flows.restore {run_ids[0]})"
        )


def compare_runs(cfg: Config, run_a: str, run_b: str, lines=None) -> dict[str, float]:
    """A's policy against B's on the test prompts (compare/... figures), logged as an MLflow run that names both;
    each run gets the tag `compare.with.<other run>` pointing at it. Holds the workspace while it reads its split and
    judge. Raises ComparisonError before anything is sampled when the runs cannot be compared."""
    from rlhfops import tracking, workspace
    from tasks.evaluation_setup import evaluation_basis, evaluation_inputs

    if run_a == run_b:
        raise ComparisonError(f"run {run_a} against itself: name two runs")
    tracking.preflight(cfg)
    tracking.setup(cfg)
    client, inputs = tracking.client(), evaluation_inputs(cfg)
    versions = [policy_version(client, run_id) for run_id in (run_a, run_b)]
    with workspace.exclusive(f"head to head of runs {run_a} and {run_b}"):
        check_basis(client, [run_a, run_b], versions, evaluation_basis(inputs))
        metrics = _judged(client, inputs, versions, lines)
    params = {"run_a": run_a, "run_b": run_b, "policy_a": versions[0], "policy_b": versions[1]}
    with tracking.start_run(cfg, name="head to head", params=params, tags={"compare": "rlhf"}) as run:
        tracking.log_metrics(metrics)
        client.set_tag(run.info.run_id, tracking.RUN_DESCRIPTION_TAG, description(run_a, run_b, metrics))
    for run_id, other in ((run_a, run_b), (run_b, run_a)):
        client.set_tag(run_id, f"{COMPARED_TAG}.{other}", run.info.run_id)
    return metrics


def _judged(client, inputs, versions: list[str], lines) -> dict[str, float]:
    """Both registered policies' answers to the test prompts, judged A against B."""
    from rlhflow.evaluation.compare import head_to_head_metrics, judge_verdicts
    from rlhflow.evaluation.held_out import HeldOutPrompts, as_precision, held_out_files, sample_answers
    from rlhflow.models.loading import load_language_model, pick_device, resolve_precision
    from rlhfops import registry
    from tasks.evaluation_setup import load_evaluation_judge

    settings, device = inputs.settings, pick_device(inputs.device)
    test_only = dataclasses.replace(settings, dev_figures=False)  # the test split alone
    files = held_out_files(inputs.validated_dir)
    held_out = HeldOutPrompts.load(files, settings.n_prompts, settings.samples_per_prompt)
    answers = []
    with tempfile.TemporaryDirectory() as tmp:
        for version in versions:
            model_dir = registry.registered_model_dir(client, registry.POLICY, version, Path(tmp) / version)
            tokenizer, policy = load_language_model(model_dir, device)
            low = as_precision(policy, resolve_precision(settings.precision, device))
            answers.append(sample_answers(test_only, low, tokenizer, held_out, lines)[1]["test"])
    judge = load_evaluation_judge(inputs, device)
    prompts, conversations = held_out.prompts["test"], held_out.conversations["test"]
    judged = judge_verdicts(judge, prompts, answers[0].texts, answers[1].texts)
    return head_to_head_metrics(answers[0], answers[1], judged, conversations)


def description(run_a: str, run_b: str, metrics: dict[str, float]) -> str:
    """The comparison run's description: which run is A, which B, and A's win rates with their intervals."""
    rows = [
        ("A's win rate over B", "compare/judge_win_rate_a_over_b", "compare/judge_win_rate"),
        ("where both answers ended", "compare/judge_win_rate_both_ended", "compare/judge_win_rate_both_ended"),
        ("length-controlled", "compare/judge_win_rate_lc", "compare/judge_win_rate_lc"),
    ]
    lines = [f"A: run `{run_a}`; B: run `{run_b}`; the judge's verdicts on the test prompts.", ""]
    lines += ["| figure | value | 95% interval |", "|---|---:|---|"]
    for label, key, interval in rows:
        if key in metrics:
            low, high = metrics.get(f"{interval}_ci_low"), metrics.get(f"{interval}_ci_high")
            shown = f"{low:.3f} to {high:.3f}" if low is not None and high is not None else ""
            lines.append(f"| {label} | {metrics[key]:.3f} | {shown} |")
    return "\n".join(lines)
