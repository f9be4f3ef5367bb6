"""What a flow run leaves in Prefect: a markdown report (stages run or skipped, metrics, the validation
summary, the evaluation report with its before/after samples) and a link to its MLflow run.

The report reads what the stages wrote (reports/validation/validation.json, reports/evaluate/report.md), so
it shows exactly what the DVC outputs and the MLflow run hold."""

from __future__ import annotations

import base64
import json
import os
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from rlhflow.config.params import Config
from rlhflow.redaction import redact_url

SUMMARY_METRICS = [
    ("rm/accuracy", "proxy reward model accuracy (held-out pairs)"),
    ("rm/length_baseline_accuracy", "length rule accuracy (same pairs)"),
    ("judge/accuracy", "judge accuracy (held-out pairs)"),
    ("judge/accuracy_minus_length_baseline", "judge minus length rule"),
    ("eval/prompts", "evaluation prompts (test conversations)"),
    ("eval/expected_half_width", "expected 95% half-width of a win rate"),
    ("eval/answers_ended_sft", "SFT answers ended"),
    ("eval/answers_cut_sft", "SFT answers cut at the limit"),
    ("eval/answers_degenerate_sft", "SFT answers degenerate"),
    ("eval/answers_ended", "policy answers ended"),
    ("eval/answers_cut", "policy answers cut at the limit"),
    ("eval/answers_degenerate", "policy answers degenerate"),
    ("eval/reward_mean", "proxy reward, policy"),
    ("eval/reward_mean_sft", "proxy reward, SFT model"),
    ("eval/win_rate_vs_sft", "proxy win rate vs SFT"),
    ("eval/judge_win_rate_vs_sft", "judge win rate vs SFT"),
    ("eval/both_ended_prompts", "answer pairs where both ended"),
    ("eval/judge_win_rate_both_ended", "judge win rate, both ended"),
    ("eval/judge_win_rate_lc", "judge win rate, length-controlled (same verdicts)"),
    ("eval/judge_win_rate_lc_supported", "  ... supported by the data (1) or not (0)"),
    ("eval/judge_soft_preference", "judge soft preference (sigmoid of score difference)"),
    ("eval/judge_soft_preference_lc", "  ... length-controlled, soft scale"),
    ("eval/proxy_judge_gap", "proxy minus judge win rate"),
    ("eval/kl", "KL(policy || SFT), nats/response"),
    ("dev/prompts", "dev prompts (choosing only)"),
    ("dev/expected_half_width", "  ... expected 95% half-width"),
    ("dev/judge_win_rate_both_ended", "  ... judge win rate, both ended"),
    ("eval/perplexity", "perplexity, policy"),
    ("eval/perplexity_sft", "perplexity, SFT model"),
]

# Where the MLflow UI is served; `make ui` sets it. Default: the tracking server itself, else `mlflow ui`'s default.
MLFLOW_UI_URL_ENV = "RLHF_MLFLOW_UI_URL"
REPORT_KEY = "rlhf-report"
LINK_KEY = "rlhf-mlflow-run"


@dataclass
class StageOutcome:
    name: str
    ran: bool
    seconds: float | None = None  # wall time when it ran
    reason: str = ""  # why it ran or was skipped


def mlflow_ui_base(tracking_uri: str) -> str:
    """Where run links point, without credentials: the links are printed and published as Prefect artifacts."""
    base = os.environ.get(MLFLOW_UI_URL_ENV)
    if not base:
        base = tracking_uri if tracking_uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
    return redact_url(base).rstrip("/")


# MLflow's UI opens in its GenAI mode (trace overview, evaluation runs) unless a link asks for model training
MODEL_TRAINING_VIEW = "?workflowType=machine_learning"


def mlflow_experiment_url(tracking_uri: str, experiment_id: str) -> str:
    """The experiment's runs, in the UI's model-training view."""
    return f"{mlflow_ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs{MODEL_TRAINING_VIEW}"


def mlflow_run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """The run's page, in the UI's model-training view."""
    return f"{mlflow_ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs/{run_id}{MODEL_TRAINING_VIEW}"


JUDGE_TRACKS_LENGTH = (
    "the judge does not beat the length rule on held-out pairs (interval of the difference reaches 0): its win rates "
    "may track answer length as much as quality"
)


# figures that count (prompts, pairs) or flag: shown without decimals in the Markdown tables
COUNT_METRICS = {"eval/prompts", "eval/both_ended_prompts", "dev/prompts", "eval/judge_win_rate_lc_supported"}


def markdown_cell(text: str) -> str:
    """`text` as one cell of a Markdown table: a `|` in it (KL(policy || SFT)) would end the cell."""
    return str(text).replace("|", "\\|")


def shown_value(key: str, value: float) -> str:
    return f"{value:.0f}" if key in COUNT_METRICS else f"{value:.4f}"


def summary_rows(results: dict[str, float]) -> list[tuple[str, float, str, str]]:
    """(label, value, its 95% interval as text or "", key) of each SUMMARY_METRICS figure the run has."""
    rows = []
    for key, label in SUMMARY_METRICS:
        if key in results:
            interval = (results.get(f"{key}_ci_low"), results.get(f"{key}_ci_high"))
            if key.endswith("_vs_sft"):  # the win rates' intervals are named without the suffix
                interval = (results.get(f"{key[:-7]}_ci_low"), results.get(f"{key[:-7]}_ci_high"))
            shown = f"{interval[0]:.3f} to {interval[1]:.3f}" if None not in interval else ""
            rows.append((label, results[key], shown, key))
    return rows


def judge_tracks_length(results: dict[str, float]) -> bool:
    low = results.get("judge/accuracy_minus_length_baseline_ci_low")
    return low is not None and not low > 0


def summary_table(results: dict[str, float]) -> str:
    """The plain-text summary printed at the end of a run."""
    lines = ["", "RLHF pipeline summary", "-" * 60]
    if judge_tracks_length(results):
        lines.append(textwrap.fill(f"NOTE: {JUDGE_TRACKS_LENGTH}.", width=96, subsequent_indent=" " * 6))
    for label, value, interval, _ in summary_rows(results):
        lines.append(f"{label:44s} {value:10.4f}{f' ({interval})' if interval else ''}")
    lines.append("-" * 60)
    for key, value in results.items():
        if key.startswith("time/"):
            lines.append(f"{'wall time, ' + key[5:-2]:44s} {value:9.1f}s")
    return "\n".join(lines)


def _demote_headings(markdown: str) -> str:
    return "\n".join("#" + line if line.startswith("#") else line for line in markdown.splitlines())


def validation_section(cfg: Config) -> list[str]:
    path = cfg.path(cfg.validate_.report_dir) / "validation.json"
    if not path.exists():
        return []
    summary = json.loads(path.read_text()).get("summary", {})
    lines = ["## Validation", "", "| check | value |", "|---|---|"]
    lines += [f"| {key.removeprefix('validate/')} | {value:g} |" for key, value in summary.items()]
    return lines + [""]


def evaluation_section(cfg: Config) -> list[str]:
    """The evaluation's report.md, its plots embedded: the Prefect UI cannot load an image by a path of this disk."""
    path = cfg.path(cfg.evaluate.report_dir) / "report.md"
    return [_demote_headings(embed_images(path.read_text(), path.parent)), ""] if path.exists() else []


def embed_images(markdown: str, root: Path) -> str:
    """`markdown` with each image it names by a relative .png path under `root` as a data URI; one that is not
    there (or lies outside `root`) is left as it is."""

    def embedded(match: re.Match) -> str:
        path = root / match[2]
        if not path.is_file() or not path.resolve().is_relative_to(root.resolve()):
            return match[0]
        return f"![{match[1]}](data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()})"

    return re.sub(r"!\[([^\]]*)\]\(([\w./-]+\.png)\)", embedded, markdown)


def run_description(
    outcomes: list[StageOutcome],
    results: dict[str, float],
    error: str | None = None,
    flow_run: tuple[str | None, str | None] = (None, None),
) -> str:
    """The parent run's description in MLflow (its Markdown note): the Prefect flow run that made it (name, page),
    what the run showed, with intervals, and its stages; within MLflow's bound on a tag's value."""
    name, url = flow_run
    lines = [f"Prefect flow run {f'[{name}]({url})' if url else f'`{name}`'}", ""] if name else []
    lines += [f"**Failed:** {error}", ""] if error else []
    if judge_tracks_length(results):
        lines += [f"Note: {JUDGE_TRACKS_LENGTH}.", ""]
    rows = summary_rows(results)
    if rows:
        lines += ["| figure | value | 95% interval |", "|---|---:|---|"]
        for label, value, interval, key in rows:
            lines.append(f"| {markdown_cell(label)} | {shown_value(key, value)} | {interval} |")
    lines += ["", "| stage | outcome | wall time |", "|---|---|---:|"]
    for o in outcomes:
        seconds = f"{o.seconds:.1f} s" if o.seconds is not None else "-"
        outcome = markdown_cell(("ran" if o.ran else "skipped") + (f": {o.reason}" if o.reason else ""))
        lines.append(f"| {o.name} | {outcome} | {seconds} |")
    return "\n".join(lines)[:MAX_DESCRIPTION_CHARS]


MAX_DESCRIPTION_CHARS = 8000  # MLflow's bound on a tag's value


def report_markdown(
    cfg: Config, outcomes: list[StageOutcome], results: dict[str, float], run_url: str | None, error: str | None = None
) -> str:
    lines = ["# RLHF pipeline run", ""]
    if run_url:
        runs = run_url.rsplit("/", 1)[0]  # the experiment's Training runs view, where runs are compared
        lines += [f"MLflow run: [{run_url}]({run_url}); compare it with other runs: [{runs}]({runs})", ""]
    if error:
        lines += [f"**Failed:** {error}", ""]
    lines += ["## Stages", "", "| stage | outcome | wall time |", "|---|---|---|"]
    for o in outcomes:
        outcome = markdown_cell(("ran" if o.ran else "skipped") + (f": {o.reason}" if o.reason else ""))
        lines.append(f"| {o.name} | {outcome} | {f'{o.seconds:.1f} s' if o.seconds is not None else '-'} |")
    labels = dict(SUMMARY_METRICS)
    shown = [k for k, _ in SUMMARY_METRICS if k in results]
    shown += sorted(k for k in results if k not in labels and not k.startswith("time/"))
    if shown:
        lines += ["", "## Metrics", "", "| metric | value |", "|---|---|"]
        lines += [f"| {markdown_cell(labels.get(k, k))} (`{k}`) | {shown_value(k, results[k])} |" for k in shown]
    lines.append("")
    names = {o.name for o in outcomes}
    if "validate" in names:
        lines += validation_section(cfg)
    if "evaluate" in names:
        lines += evaluation_section(cfg)
    return "\n".join(lines)
