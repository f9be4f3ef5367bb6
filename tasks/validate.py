"""Stage validate: read the preference data, run the Great Expectations suite, write the train, judge, dev and test
splits (by conversation, rlhflow/data/splits.py: the judge's reward model trains on conversations that neither the
proxy reward model nor PPO sees, no branch of a held-out conversation is trained on, dev is for choosing and test
for the report). The split depends on
validate.split_seed alone, not on the training seed.

Blank and over-long rows are dropped and counted per reason (validate.blank / validate.overlong), up to
validate.max_dropped_fraction of the rows. On any other failed expectation the stage raises with a message naming
each expectation and a few offending rows; the previous validated splits and report stay as they were, and the
failed report is written next to them (`<report_dir>.failed/`) and logged on the failed MLflow run.
"""

from __future__ import annotations

import shutil

from rlhflow.config.params import Config
from rlhflow.fsutil import atomic_dir, remove_made
from rlhfops.stage_runner import StageContext, cli, stage_task

# A light door: pandas, great_expectations, torch, transformers and mlflow (the readers and splits, the suite, the
# tokenizer, the tracking) are imported inside the functions that use them, so the stage's --help and its checks answer
# before any of them loads.

NAME = "validate"


def _source(cfg: Config, value: str) -> str:
    """A local path (resolved against the repo) when it exists, else the value as given (a dataset name)."""
    path = cfg.path(value)
    return str(path) if path.exists() else value


def run(cfg: Config, ctx: StageContext) -> dict[str, float]:
    import mlflow

    from rlhflow.data.splits import cross_split_prefix_pairs
    from rlhflow.data.validation import DataValidationError
    from rlhflow.models.loading import load_tokenizer
    from rlhfops import tracking

    splits, shared_with_test = read_splits(cfg)
    labelled, label_counts = read_labelled(cfg, splits)
    if len(labelled):
        splits["labelled"] = labelled
    tokenizer = load_tokenizer(cfg.sft.model, trust_remote_code=cfg.sft.trust_remote_code)
    out_dir, report_dir = cfg.path(cfg.validate_.out_dir), cfg.path(cfg.validate_.report_dir)
    failed_dir = report_dir.with_name(report_dir.name + ".failed")
    try:
        result, written = validate_and_write(cfg, splits, tokenizer, failed_dir)
    except DataValidationError:
        if failed_dir.exists():
            mlflow.log_artifacts(str(failed_dir), artifact_path="validation_failed")
        raise
    remove_made(failed_dir)

    mlflow.log_artifacts(str(report_dir), artifact_path="validation")
    tracking.log_dataset(out_dir / "train.jsonl", name="preferences-train", context="training")
    tracking.log_dataset(out_dir / "test.jsonl", name="preferences-test", context="evaluation")
    for split, context in (("judge", "judge"), ("dev", "selection"), ("labelled", "feedback")):
        if (out_dir / f"{split}.jsonl").exists():
            tracking.log_dataset(out_dir / f"{split}.jsonl", name=f"preferences-{split}", context=context)
    for reason, count in sorted(result.dropped_per_reason.items()):
        print(f"validate: dropped {count} row(s): {reason}", flush=True)
    summary = result.summary() | {
        "validate/cross_split_prefix_pairs": float(cross_split_prefix_pairs(written)),
        "validate/rows_shared_with_test_file": float(shared_with_test),
        **{f"validate/feedback_{name}": count for name, count in label_counts.items()},
    }
    ctx.log_metrics(summary)
    return summary


def read_splits(cfg: Config):
    """The preference data split by conversation (with `data.test_preferences`, that file is the test split), and
    how many training rows were left out for sharing a conversation with it."""
    from rlhflow.data.formats import load_preferences
    from rlhflow.data.splits import assign_splits

    v = cfg.validate_
    data = load_preferences(_source(cfg, cfg.data.preferences), hf_split=cfg.data.hf_split, max_rows=v.max_rows)
    test = None
    if cfg.data.test_preferences:
        test = load_preferences(
            _source(cfg, cfg.data.test_preferences), hf_split=cfg.data.hf_split, max_rows=v.max_rows
        )
    splits = assign_splits(
        data,
        test_fraction=v.test_fraction,
        dev_fraction=v.dev_fraction,
        judge_fraction=v.judge_fraction,
        feedback_fraction=v.feedback_fraction,
        seed=v.split_seed,
        test=test,
    )
    # with a held-out file, training rows of a conversation that the test file holds are left out
    shared_with_test = (
        len(data) - sum(len(df) for split, df in splits.items() if split != "test") if test is not None else 0
    )
    if shared_with_test:
        print(
            f"validate: left out {shared_with_test} training row(s) whose conversation is in data.test_preferences",
            flush=True,
        )
    return splits, shared_with_test


def read_labelled(cfg: Config, splits: dict):
    """The labelled pairs of feedback.labels_file as preference rows (rlhflow/data/feedback.py), and the counts of
    what the labels settled. A labelled prompt from a held-out conversation (judge, dev, test) fails: people's
    labels on it would leak into training."""
    from rlhflow.data.feedback import LABEL_FIELDS, PAIR_FIELDS, FeedbackError, labelled_preferences, read_records
    from rlhflow.data.splits import held_out_keys

    f = cfg.feedback
    pairs = read_records(cfg.path(f.pairs_file), PAIR_FIELDS)
    labels = read_records(cfg.path(f.labels_file), LABEL_FIELDS)
    if not labels:
        return [], {}
    labelled, counts = labelled_preferences(pairs, labels)
    held_out = set().union(*(set(held_out_keys(splits[s])) for s in ("judge", "dev", "test") if s in splits))
    leaked = [int(r) for r, key in zip(labelled["source_row"], held_out_keys(labelled)) if key in held_out]
    if leaked:
        raise FeedbackError(
            f"{f.pairs_file}: {len(leaked)} labelled pair(s) from a held-out conversation (judge, dev or test), "
            f"pairs file rows {leaked[:10]}: labels come from the feedback split only"
        )
    print(
        f"validate: {len(labelled)} labelled pair(s) from {f.labels_file}; "
        + ", ".join(f"{int(v)} {k}" for k, v in counts.items() if k in ("tie", "skip", "conflict", "unlabelled") and v),
        flush=True,
    )
    return labelled, counts


def validate_and_write(cfg: Config, splits: dict, tokenizer, failed_dir):
    """The suite on every split; the kept rows written as the splits and the report beside them, each replaced
    whole. On a failed expectation nothing is replaced and the report goes to `failed_dir`."""
    from rlhflow.data.readers import write_jsonl
    from rlhflow.data.validation import DataValidationError, validate_preferences

    out_dir, report_dir = cfg.path(cfg.validate_.out_dir), cfg.path(cfg.validate_.report_dir)
    with atomic_dir(report_dir, setting="validate.report_dir") as tmp_report:
        try:
            result = validate_preferences(splits, cfg=cfg.validate_, tokenizer=tokenizer, report_dir=tmp_report)
        except DataValidationError:
            if remove_made(failed_dir) or not failed_dir.exists():  # one the pipeline did not make stays
                shutil.copytree(tmp_report, failed_dir)  # marked, as tmp_report is
            raise
        written = {split: result.kept(split, df) for split, df in splits.items()}
        with atomic_dir(out_dir, setting="validate.out_dir") as tmp_out:
            for split, df in written.items():  # train.jsonl, judge.jsonl, dev.jsonl, test.jsonl
                write_jsonl(df, tmp_out / f"{split}.jsonl")
    return result, written


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
