"""The data-validation suite for preference pairs, run with Great Expectations (docs/data.md#validation).

`validate_preferences` runs one expectation suite on each split (made by `rlhflow.data.splits`) in an ephemeral GE
context, maps every failing row back to its `source_row` in the input, writes `validation.json` and
`validation.html`, and raises `DataValidationError` naming the failed expectations and their rows. Blank and
over-long rows are a policy (`validate.blank`, `validate.overlong`: `drop` within `validate.max_dropped_fraction`,
or `fail`). Checks GE has no single expectation for use helper columns (`<column>_tokens`,
`conversation_in_other_split`) or its multi-column expectations (chosen != rejected).
"""

from __future__ import annotations

# great_expectations is heavy: it is imported inside the functions that run the suite.
import html
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from rlhflow.config.params import ValidateConfig
from rlhflow.data.splits import conversation_keys
from rlhflow.fsutil import write_text_atomic

# GE reads these at import time: no usage analytics from a pipeline run.
os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")

TEXT_COLUMNS = ("prompt", "chosen", "rejected")
DEMONSTRATION_TEXT_COLUMNS = ("prompt", "completion")  # demonstrations for supervised fine-tuning: the same checks
SPLITS = ("train", "judge", "test")
# labelled pairs are people's labels on answers to the feedback split's prompts: the same conversations by design
SAME_CONVERSATIONS = {"labelled": {"feedback"}, "feedback": {"labelled"}}
SNIPPET_CHARS = 60


class DataValidationError(ValueError):
    """The preference data failed validation; `.result` holds the full `ValidationResult`."""

    def __init__(self, result: ValidationResult):
        self.result = result
        super().__init__(result.failure_message())


@dataclass
class ExpectationOutcome:
    """One expectation, merged over the splits it ran on."""

    expectation: str  # GE's name, e.g. expect_column_values_to_not_be_null
    column: str  # the column(s) it is about, e.g. "chosen" or "chosen, rejected"
    description: str  # what it means for preference data, in words
    problem: str = ""  # what is wrong with a row it flags, in plain words ("a blank prompt (...)")
    success: bool = True
    unexpected_count: int = 0
    unexpected_per_split: dict[str, int] = field(default_factory=dict)
    examples: list[dict] = field(default_factory=list)  # {"split", "source_row", "snippet"}
    observed: dict[str, Any] = field(default_factory=dict)  # per split, for table-level expectations
    errors: list[str] = field(default_factory=list)  # GE could not evaluate it
    drop_reason: str = ""  # e.g. "overlong_prompt": the rows it flags were dropped under that policy
    dropped_count: int = 0
    dropped_examples: list[dict] = field(default_factory=list)
    message: str = ""  # a failure that is not about single rows, in full

    @property
    def name(self) -> str:
        return f"{self.expectation}({self.column})"

    def failure_line(self) -> str:
        if self.message:
            return f"{self.name}: {self.message}"
        if self.errors:
            return f"{self.name}: could not be evaluated: {'; '.join(self.errors)}"
        if not self.unexpected_count:
            found = ", ".join(f"{split}: {value}" for split, value in self.observed.items())
            return f"{self.name}: {self.description} failed ({found})"
        return f"{self.name}: {_rows_line(self.unexpected_count, self.problem, self.examples)}"


def _rows_line(count: int, problem: str, examples: list[dict]) -> str:
    """`3 rows with a blank prompt (...) — train row 5: prompt=""; ...`"""
    shown = "; ".join(f"{e['split']} row {e['source_row']}: {e['snippet']}" for e in examples)
    more = count - len(examples)
    return (
        f"{count} row{'s' if count != 1 else ''}"
        + (f" with {problem}" if problem else "")
        + f" — {shown}"
        + (f"; ... and {more} more" if more > 0 else "")
    )


@dataclass
class ValidationResult:
    success: bool
    expectations: list[ExpectationOutcome]
    statistics: dict[str, dict[str, float]]  # per split: rows, prompts, token length means and maxima
    dropped: dict[str, list[int]] = field(default_factory=dict)  # per split: positions of the rows dropped
    total_rows: int = 0
    report_json: str = ""
    report_html: str = ""

    @property
    def failed(self) -> list[ExpectationOutcome]:
        return [e for e in self.expectations if not e.success]

    @property
    def dropped_per_reason(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for e in self.expectations:
            if e.dropped_count:
                counts[e.drop_reason] = counts.get(e.drop_reason, 0) + e.dropped_count
        return counts

    @property
    def dropped_rows(self) -> int:
        return sum(len(rows) for rows in self.dropped.values())

    def kept(self, split: str, df: pd.DataFrame) -> pd.DataFrame:
        """The split's rows that were not dropped (df as passed to `validate_preferences`)."""
        df = df.reset_index(drop=True)
        return df.drop(index=self.dropped.get(split, [])).reset_index(drop=True)

    def summary(self) -> dict[str, float]:
        """Flat numeric values for MLflow metrics."""
        out = {
            "validate/success": float(self.success),
            "validate/expectations_evaluated": float(len(self.expectations)),
            "validate/expectations_passed": float(len(self.expectations) - len(self.failed)),
            "validate/expectations_failed": float(len(self.failed)),
            "validate/unexpected_rows": float(sum(e.unexpected_count for e in self.expectations)),
            "validate/dropped_rows": float(self.dropped_rows),
            "validate/dropped_fraction": self.dropped_rows / self.total_rows if self.total_rows else 0.0,
        }
        for reason, count in sorted(self.dropped_per_reason.items()):
            out[f"validate/dropped_{reason}"] = float(count)
        for split, stats in self.statistics.items():
            for key, value in stats.items():
                out[f"validate/{split}_{key}"] = float(value)
        return out

    def failure_message(self) -> str:
        lines = [
            f"data validation failed: {len(self.failed)} of {len(self.expectations)} expectations failed"
            + (f" (report: {self.report_html})" if self.report_html else "")
        ]
        lines += [f"  {e.failure_line()}" for e in self.failed]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "success": self.success,
            "summary": self.summary(),
            "dropped": {
                "rows": self.dropped_rows,
                "per_reason": self.dropped_per_reason,
                "rows_per_split": {s: len(rows) for s, rows in self.dropped.items()},
            },
            "statistics": self.statistics,
            "expectations": [asdict(e) | {"name": e.name} for e in self.expectations],
        }


# ---- the suite --------------------------------------------------------------------------------------


@dataclass
class _Check:
    expectation: Any  # a GE Expectation
    column: str  # for messages
    description: str
    show: tuple[str, ...]  # columns whose values illustrate an offending row
    problem: str = ""  # what is wrong with a row it flags, in plain words
    drop_policy: str = ""  # "blank" or "overlong": the ValidateConfig field saying whether its rows may be dropped
    drop_above: float | None = None  # only rows whose checked value exceeds this may be dropped (too short fails)


def _checks(df: pd.DataFrame, cfg: ValidateConfig, columns: tuple[str, ...] = TEXT_COLUMNS) -> list[_Check]:
    """The suite's expectations, in the order they are reported: rows and columns present, each text column's
    values, their token lengths, then the checks across columns and rows."""
    import great_expectations.expectations as gxe

    present = [c for c in columns if c in df.columns]
    checks = [_Check(gxe.ExpectTableRowCountToBeBetween(min_value=1), "table", "the split has rows", ())]
    for column in columns:
        checks.append(_Check(gxe.ExpectColumnToExist(column=column), column, f"column {column} is present", ()))
    for column in present:
        checks += _value_checks(column)
    # the prompt has an upper bound only; every other text column is a response
    for column in present:
        low, high = (None, cfg.max_prompt_tokens) if column == "prompt" else (cfg.min_tokens, cfg.max_response_tokens)
        checks.append(_length_check(column, low, high))
    return checks + _row_checks(df, present, columns)


def _value_checks(column: str) -> list[_Check]:
    import great_expectations.expectations as gxe

    show = (column,) if column == "prompt" else ("prompt", column)
    return [
        _Check(
            gxe.ExpectColumnValuesToNotBeNull(column=column),
            column,
            f"{column} is never null",
            ("prompt",) if column != "prompt" else (),
            problem=f"no {column} (null)",
        ),
        _Check(
            gxe.ExpectColumnValuesToBeOfType(column=column, type_="str"),
            column,
            f"{column} values are strings",
            (column,),
            problem=f"a {column} that is not a string",
        ),
        _Check(
            gxe.ExpectColumnValuesToNotMatchRegex(column=column, regex=r"^\s*$"),
            column,
            f"{column} is not empty or whitespace",
            show,
            problem=f"a blank {column} (empty or whitespace only)",
            drop_policy="blank",
        ),
    ]


def _length_check(column: str, low: int | None, high: int) -> _Check:
    import great_expectations.expectations as gxe

    words = f"at most {high}" if low is None else f"between {low} and {high}"
    problem = (
        f"an over-long {column} (more than {high} tokens)"
        if low is None
        else f"a {column} shorter than {low} or longer than {high} tokens"
    )
    return _Check(
        gxe.ExpectColumnValuesToBeBetween(column=f"{column}_tokens", min_value=low, max_value=high),
        f"{column}_tokens",
        f"{column} is {words} tokens long",
        (f"{column}_tokens", column),
        problem=problem,
        drop_policy="overlong",
        drop_above=high,
    )


def _row_checks(df: pd.DataFrame, present: list[str], columns: tuple[str, ...]) -> list[_Check]:
    """Across columns and rows: chosen differs from rejected, no duplicate rows, no conversation in two splits."""
    import great_expectations.expectations as gxe

    checks = []
    if "chosen" in present and "rejected" in present:
        checks.append(
            _Check(
                gxe.ExpectSelectColumnValuesToBeUniqueWithinRecord(column_list=["chosen", "rejected"]),
                "chosen, rejected",
                "chosen differs from rejected",
                ("chosen",),
                problem="chosen identical to rejected",
            )
        )
    if len(present) == len(columns):
        names, unit = ", ".join(columns), "pair" if columns == TEXT_COLUMNS else "row"
        checks.append(
            _Check(
                gxe.ExpectCompoundColumnsToBeUnique(column_list=list(columns)),
                names,
                f"no duplicate ({names}) {unit}s",
                columns[:2],
                problem=f"a duplicate ({names}) {unit}",
            )
        )
    if "conversation_in_other_split" in df.columns:
        checks.append(
            _Check(
                gxe.ExpectColumnValuesToBeInSet(column="conversation_in_other_split", value_set=[False]),
                "conversation_in_other_split",
                "no conversation is shared between splits",
                ("prompt",),
                problem="a conversation (first user turn) that is also in another split",
            )
        )
    return checks


def _with_helper_columns(df: pd.DataFrame, tokenizer, columns: tuple[str, ...] = TEXT_COLUMNS) -> pd.DataFrame:
    """A copy indexed 0..n-1 with `source_row` and `<column>_tokens` (NaN where the text is missing)."""
    df = df.reset_index(drop=True).copy()
    if "source_row" not in df.columns:
        df["source_row"] = range(1, len(df) + 1)
    for column in columns:
        if column in df.columns:
            df[f"{column}_tokens"] = _token_counts(df[column], tokenizer)
    return df


def _mark_shared_conversations(frames: dict[str, pd.DataFrame]) -> None:
    """Helper column `conversation_in_other_split` (rlhflow.data.splits.conversation_key). (A GE value set of the
    other splits' keys would be re-serialised thousands of times inside GE, which gets slow for large datasets.)"""
    if len(frames) < 2 or not all("prompt" in df.columns for df in frames.values()):
        return
    keys = {split: conversation_keys(df) for split, df in frames.items()}
    for split, df in frames.items():
        own = {split} | SAME_CONVERSATIONS.get(split, set())
        elsewhere = set().union(*(set(k) for other, k in keys.items() if other not in own))
        df["conversation_in_other_split"] = keys[split].isin(elsewhere).to_numpy(dtype=bool)


def _token_counts(values: pd.Series, tokenizer, batch_size: int = 4096) -> pd.Series:
    counts = pd.Series(float("nan"), index=values.index, dtype="float64")
    texts = {i: v for i, v in values.items() if isinstance(v, str) and v.strip()}  # blanks have their own check
    keys = list(texts)
    for start in range(0, len(keys), batch_size):
        batch = keys[start : start + batch_size]
        ids = tokenizer([texts[i] for i in batch], add_special_tokens=False)["input_ids"]
        counts.loc[batch] = [len(x) for x in ids]
    return counts


def _snippet(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if not isinstance(value, str):
        return repr(value)
    flat = " ".join(value.split()) if value.strip() else value
    return json.dumps(flat[:SNIPPET_CHARS] + ("…" if len(flat) > SNIPPET_CHARS else ""), ensure_ascii=False)


def _error_messages(info: Any) -> list[str]:
    """GE 1.x puts exception details either flat or nested per metric; collect the messages."""
    if not isinstance(info, dict):
        return []
    if info.get("raised_exception"):
        return [str(info.get("exception_message"))]
    return [m for value in info.values() for m in _error_messages(value)]


def _run_suite(context, split: str, df: pd.DataFrame, checks: list[_Check]) -> dict[str, dict]:
    """Validate one split; returns GE's result per check (keyed by the check's position)."""
    import great_expectations as gx

    batch = (
        context.data_sources.add_pandas(f"preferences_{split}")
        .add_dataframe_asset(split)
        .add_batch_definition_whole_dataframe("all_rows")
        .get_batch(batch_parameters={"dataframe": df})
    )
    # The suite is not saved to the context: saving re-serialises it on every added expectation.
    suite = gx.ExpectationSuite(name=f"preferences_{split}")
    for i, check in enumerate(checks):
        check.expectation.meta = {"check": i}
        suite.add_expectation(check.expectation)
    results = batch.validate(suite, result_format={"result_format": "COMPLETE"})
    return {r.expectation_config.meta["check"]: r for r in results.results}  # results come back reordered


def _example(df: pd.DataFrame, index: int, split: str, check: _Check) -> dict:
    row = df.loc[index]
    shown = ", ".join(f"{c}={_snippet(row[c])}" for c in check.show if c in df.columns)
    return {"split": split, "source_row": int(row["source_row"]), "snippet": shown}


def _droppable(check: _Check, df: pd.DataFrame, indexes: list[int], cfg: ValidateConfig) -> list[int]:
    """The flagged rows that the check's policy (validate.blank / validate.overlong = drop) lets us drop."""
    if not check.drop_policy or getattr(cfg, check.drop_policy) != "drop":
        return []
    if check.drop_above is None:
        return list(indexes)
    values = df[check.expectation.column]
    return [i for i in indexes if values[i] > check.drop_above]


def _merge(
    outcomes: dict[str, ExpectationOutcome],
    split: str,
    df: pd.DataFrame,
    check: _Check,
    result,
    cfg: ValidateConfig,
    dropped: set[int],
) -> None:
    """Fold one split's result of one check into its outcome; rows it may drop go to `dropped`, not failures."""
    max_examples = cfg.examples_per_failure
    name = f"{check.expectation.expectation_type}({check.column})"
    outcome = outcomes.setdefault(
        name, ExpectationOutcome(check.expectation.expectation_type, check.column, check.description, check.problem)
    )
    res = result.result or {}
    errors = _error_messages(result.exception_info)
    outcome.errors += [f"{split}: {e}" for e in errors]
    indexes = res.get("unexpected_index_list") or []
    drop = _droppable(check, df, indexes, cfg)
    if drop:
        outcome.drop_reason = f"{check.drop_policy}_{check.column.removesuffix('_tokens')}"
        outcome.dropped_count += len(drop)
        dropped.update(drop)
        outcome.dropped_examples += [
            _example(df, i, split, check) for i in drop[: max(0, max_examples - len(outcome.dropped_examples))]
        ]
        kept = set(drop)
        indexes = [i for i in indexes if i not in kept]
    passed = bool(result.success) or (bool(drop) and not indexes)
    outcome.success = outcome.success and passed and not errors
    if "observed_value" in res:
        outcome.observed[split] = res["observed_value"]
    if check.expectation.expectation_type == "expect_column_to_exist" and not result.success:
        outcome.observed[split] = f"missing (columns: {', '.join(c for c in df.columns if not c.endswith('_tokens'))})"
    count = len(indexes) if drop else int(res.get("unexpected_count") or len(indexes))
    if count:
        outcome.unexpected_per_split[split] = count
        outcome.unexpected_count += count
    outcome.examples += [_example(df, i, split, check) for i in indexes[: max(0, max_examples - len(outcome.examples))]]


def _statistics(df: pd.DataFrame, columns: tuple[str, ...] = TEXT_COLUMNS) -> dict[str, float]:
    stats = {"rows": float(len(df))}
    if "prompt" in df.columns:
        stats["prompts"] = float(df["prompt"].astype(str).nunique())
        stats["conversations"] = float(conversation_keys(df).nunique())
    for column in columns:
        tokens = df.get(f"{column}_tokens")
        if tokens is not None and tokens.notna().any():
            stats[f"mean_{column}_tokens"] = round(float(tokens.mean()), 2)
            stats[f"max_{column}_tokens"] = float(tokens.max())
    return stats


def validate_preferences(
    splits: dict[str, pd.DataFrame],
    *,
    cfg: ValidateConfig,
    tokenizer,
    report_dir: Path,
    columns: tuple[str, ...] = TEXT_COLUMNS,
) -> ValidationResult:
    """Run the suite on every split (e.g. train, judge, test), write the JSON and HTML reports, raise
    DataValidationError on failure. Rows dropped under the blank/over-long policies are in `result.dropped`;
    `result.kept(split, df)` gives what to write. `columns`: the text columns checked (the prompt first), by default
    preference pairs'; demonstrations pass DEMONSTRATION_TEXT_COLUMNS."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)

    frames = {split: _with_helper_columns(df, tokenizer, columns) for split, df in splits.items()}
    _mark_shared_conversations(frames)
    outcomes: dict[str, ExpectationOutcome] = {}
    dropped: dict[str, set[int]] = {split: set() for split in frames}
    for split, df in frames.items():
        checks = _checks(df, cfg, columns)
        results = _run_suite(context, split, df, checks)
        for i, check in enumerate(checks):  # in suite order: GE returns results reordered
            _merge(outcomes, split, df, check, results[i], cfg, dropped[split])

    expectations = list(outcomes.values())
    total = sum(len(df) for df in frames.values())
    n_dropped = sum(len(rows) for rows in dropped.values())
    if n_dropped:
        expectations.append(_dropped_share_outcome(expectations, n_dropped, total, cfg))
    result = ValidationResult(
        success=all(e.success for e in expectations),
        expectations=expectations,
        statistics={
            split: _statistics(df.drop(index=sorted(dropped[split])), columns)
            | {"rows_dropped": float(len(dropped[split]))}
            for split, df in frames.items()
        },
        dropped={split: sorted(rows) for split, rows in dropped.items() if rows},
        total_rows=total,
    )
    report_dir = Path(report_dir)
    result.report_json = str(report_dir / "validation.json")
    result.report_html = str(report_dir / "validation.html")
    write_text_atomic(Path(result.report_json), json.dumps(result.to_dict(), indent=2, ensure_ascii=False, default=str))
    write_text_atomic(Path(result.report_html), render_html(result))
    if not result.success:
        raise DataValidationError(result)
    return result


def _dropped_share_outcome(
    expectations: list[ExpectationOutcome], n_dropped: int, total: int, cfg: ValidateConfig
) -> ExpectationOutcome:
    """The dropped rows as one more expectation: at most `max_dropped_fraction` of all rows."""
    share = n_dropped / total
    outcome = ExpectationOutcome(
        "max_dropped_fraction",
        "rows",
        f"at most {cfg.max_dropped_fraction:.1%} of the rows dropped as blank or over-long",
    )
    outcome.observed["all"] = f"{n_dropped} of {total} rows ({share:.1%})"
    outcome.success = share <= cfg.max_dropped_fraction
    if not outcome.success:
        reasons = ", ".join(f"{e.drop_reason}: {e.dropped_count}" for e in expectations if e.dropped_count)
        examples = [x for e in expectations for x in e.dropped_examples][: cfg.examples_per_failure]
        outcome.message = (
            f"{n_dropped} of {total} rows ({share:.1%}) would be dropped, more than validate.max_dropped_fraction="
            f"{cfg.max_dropped_fraction} ({reasons}) — "
            + "; ".join(f"{x['split']} row {x['source_row']}: {x['snippet']}" for x in examples)
            + ". Fix the data, raise the token limits, or set validate.overlong/validate.blank=fail to list every row"
        )
    return outcome


# ---- reports ------------------------------------------------------------------------------------------


def render_html(result: ValidationResult) -> str:
    """A self-contained page: overall status, split statistics, every expectation with example rows."""
    esc = html.escape
    status = "passed" if result.success else "FAILED"
    stat_keys = sorted({k for stats in result.statistics.values() for k in stats})
    stats_rows = "".join(
        f"<tr><td>{esc(k)}</td>"
        + "".join(f"<td>{result.statistics[s].get(k, '')}</td>" for s in result.statistics)
        + "</tr>"
        for k in stat_keys
    )
    reasons = result.dropped_per_reason
    dropped_reasons = (" (" + esc(", ".join(f"{r}: {n}" for r, n in sorted(reasons.items()))) + ")") if reasons else ""
    exp_rows = []
    for e in result.expectations:
        counts = ", ".join(f"{s}: {n}" for s, n in e.unexpected_per_split.items()) or "0"
        details = [f"{esc(x['split'])} row {x['source_row']}: {esc(x['snippet'])}" for x in e.examples]
        details += [
            f"dropped: {esc(x['split'])} row {x['source_row']}: {esc(x['snippet'])}" for x in e.dropped_examples
        ]
        details += [esc(e.message)] if e.message else []
        if e.dropped_count:
            counts += f"; dropped ({esc(e.drop_reason)}): {e.dropped_count}"
        details += [esc(f"{s}: {v}") for s, v in e.observed.items() if not e.success]
        details += [esc(err) for err in e.errors]
        exp_rows.append(
            f"<tr class='{'ok' if e.success else 'bad'}'><td>{'✓' if e.success else '✗'}</td>"
            f"<td><code>{esc(e.expectation)}</code></td><td>{esc(e.column)}</td><td>{esc(e.description)}</td>"
            f"<td>{esc(counts)}</td><td>{'<br>'.join(details)}</td></tr>"
        )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Preference data validation: {status}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }} table {{ border-collapse: collapse; margin-bottom: 2em; }}
td, th {{ border: 1px solid #ccc; padding: 4px 8px; vertical-align: top; text-align: left; }}
tr.ok td:first-child {{ color: #080; }} tr.bad {{ background: #fdd; }}
</style></head><body>
<h1>Preference data validation: {status}</h1>
<p>{len(result.expectations) - len(result.failed)} of {len(result.expectations)} expectations passed
(Great Expectations suite; rows are numbered as in the input file).</p>
<p>Dropped rows: {result.dropped_rows} of {result.total_rows}{dropped_reasons}.</p>
<h2>Statistics</h2>
<table><tr><th></th>{"".join(f"<th>{esc(s)}</th>" for s in result.statistics)}</tr>{stats_rows}</table>
<h2>Expectations</h2>
<table><tr><th></th><th>expectation</th><th>column</th><th>meaning</th><th>unexpected rows</th><th>examples</th></tr>
{"".join(exp_rows)}</table>
</body></html>
"""
