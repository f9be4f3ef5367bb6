"""Stage validate: read the preference data, run the Great Expectations suite, write train/test splits.

On any failed expectation the stage raises with a message naming each expectation and a few offending
rows; the previous validated splits and report stay as they were, and the failed report is written next
to them (`<report_dir>.failed/`) and logged on the failed MLflow run.
"""

from __future__ import annotations

import shutil

from rlhflow.config import Config
from tasks._common import StageContext, cli, stage_task

NAME = "validate"


def _source(cfg: Config, value: str) -> str:
    """A local path (resolved against the repo) when it exists, else the value as given (a dataset name)."""
    path = cfg.path(value)
    return str(path) if path.exists() else value


def run(cfg: Config, ctx: StageContext) -> dict[str, float]:
    import mlflow

    from rlhflow import tracking
    from rlhflow.data.formats import load_preferences, write_jsonl
    from rlhflow.fsutil import atomic_dir
    from rlhflow.models import load_tokenizer
    from rlhflow.validation import DataValidationError, split_by_prompt, validate_preferences

    limit = cfg.validate_.max_rows
    data = load_preferences(_source(cfg, cfg.data.preferences), hf_split=cfg.data.hf_split, max_rows=limit)
    if cfg.data.test_preferences:
        train = data
        test = load_preferences(_source(cfg, cfg.data.test_preferences), hf_split=cfg.data.hf_split, max_rows=limit)
    else:
        train, test = split_by_prompt(data, cfg.validate_.test_fraction, cfg.seed)
    tokenizer = load_tokenizer(cfg.sft.model, trust_remote_code=cfg.sft.trust_remote_code)

    out_dir, report_dir = cfg.path(cfg.validate_.out_dir), cfg.path(cfg.validate_.report_dir)
    failed_dir = report_dir.with_name(report_dir.name + ".failed")
    try:
        with atomic_dir(report_dir) as tmp_report:
            try:
                result = validate_preferences(train, test, cfg=cfg.validate_, tokenizer=tokenizer, report_dir=tmp_report)
            except DataValidationError:
                shutil.rmtree(failed_dir, ignore_errors=True)
                shutil.copytree(tmp_report, failed_dir)
                raise
            with atomic_dir(out_dir) as tmp_out:
                write_jsonl(train, tmp_out / "train.jsonl")
                write_jsonl(test, tmp_out / "test.jsonl")
    except DataValidationError:
        if failed_dir.exists():
            mlflow.log_artifacts(str(failed_dir), artifact_path="validation_failed")
        raise
    shutil.rmtree(failed_dir, ignore_errors=True)

    mlflow.log_artifacts(str(report_dir), artifact_path="validation")
    tracking.log_dataset(out_dir / "train.jsonl", name="preferences-train", context="training")
    tracking.log_dataset(out_dir / "test.jsonl", name="preferences-test", context="evaluation")
    summary = result.summary()
    ctx.log_metrics(summary)
    return summary


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
