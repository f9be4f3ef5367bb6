"""The Great Expectations suite: good data passes; each kind of bad data fails naming split and source rows."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from rlhflow.config.params import ValidateConfig
from rlhflow.data.formats import load_preferences
from rlhflow.data.splits import assign_splits
from rlhflow.data.validation import DataValidationError, validate_preferences
from rlhflow.fsutil import MADE_MARKER, mark_made
from tests.fixtures import tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def pairs(n: int, start_row: int = 1, prefix: str = "train") -> pd.DataFrame:
    return pd.DataFrame(
        {
            "prompt": [f"{prefix} question {i}: how do I boil water?" for i in range(n)],
            "chosen": [f"Put a pot of water on the stove and heat it for {i + 2} minutes." for i in range(n)],
            "rejected": ["No." for _ in range(n)],
            "source_row": list(range(start_row, start_row + n)),
        }
    )


def run(train, test, tokenizer, tmp_path, **cfg):
    return validate_preferences(
        {"train": train, "test": test}, cfg=ValidateConfig(**cfg), tokenizer=tokenizer, report_dir=tmp_path
    )


def failure(train, test, tokenizer, tmp_path, **cfg) -> DataValidationError:
    with pytest.raises(DataValidationError) as err:
        run(train, test, tokenizer, tmp_path, **cfg)
    return err.value


def failed_line(err: DataValidationError, name: str) -> str:
    lines = [line for line in str(err).splitlines() if line.strip().startswith(name)]
    assert lines, f"{name} not among the failures:\n{err}"
    return lines[0]


# ---- good data ----------------------------------------------------------------------------------------


def test_valid_data_passes_and_writes_reports(tokenizer, tmp_path):
    mark_made(tmp_path, "validate.report_dir")  # as the stage's report directory is: its files need no record
    result = run(pairs(8), pairs(3, prefix="test"), tokenizer, tmp_path)
    assert result.success and not result.failed
    summary = result.summary()
    assert summary["validate/train_rows"] == 8 and summary["validate/test_rows"] == 3
    assert summary["validate/expectations_failed"] == 0
    assert summary["validate/expectations_passed"] == len(result.expectations) >= 15
    assert summary["validate/train_mean_chosen_tokens"] > summary["validate/train_mean_rejected_tokens"] > 0
    report = json.loads((tmp_path / "validation.json").read_text())
    assert report["success"] is True and len(report["expectations"]) == len(result.expectations)
    page = (tmp_path / "validation.html").read_text()
    assert "Preference data validation: passed" in page and "expect_column_values_to_not_be_null" in page
    assert sorted(p.name for p in tmp_path.iterdir()) == [MADE_MARKER, "validation.html", "validation.json"]


# ---- bad data: each names the expectation, the split and the source rows ------------------------------------


def test_missing_column(tokenizer, tmp_path):
    err = failure(pairs(4).drop(columns="rejected"), pairs(2, prefix="test"), tokenizer, tmp_path)
    line = failed_line(err, "expect_column_to_exist(rejected)")
    assert "train: missing" in line and "prompt, chosen, source_row" in line
    assert (tmp_path / "validation.json").exists()  # reports are written on failure too


def test_nulls(tokenizer, tmp_path):
    train = pairs(6, start_row=10)
    train.loc[[1, 4], "chosen"] = None
    err = failure(train, pairs(2, prefix="test"), tokenizer, tmp_path)
    line = failed_line(err, "expect_column_values_to_not_be_null(chosen)")
    assert "2 rows" in line and "train row 11:" in line and "train row 14:" in line
    assert 'prompt="train question 1' in line  # the row is shown by its prompt, as the value is null


def test_empty_and_whitespace_strings(tokenizer, tmp_path):
    test = pairs(4, start_row=101, prefix="test")
    test.loc[2, "rejected"] = "   \n"
    test.loc[3, "prompt"] = ""
    err = failure(pairs(4), test, tokenizer, tmp_path, blank="fail")
    line = failed_line(err, "expect_column_values_to_not_match_regex(rejected)")
    assert "1 row with a blank rejected (empty or whitespace only) — test row 103:" in line
    line = failed_line(err, "expect_column_values_to_not_match_regex(prompt)")
    assert "1 row with a blank prompt (empty or whitespace only) — test row 104:" in line


def test_chosen_equal_to_rejected(tokenizer, tmp_path):
    train = pairs(5)
    train.loc[[0, 3], "rejected"] = train.loc[[0, 3], "chosen"]
    err = failure(train, pairs(2, prefix="test"), tokenizer, tmp_path)
    line = failed_line(err, "expect_select_column_values_to_be_unique_within_record(chosen, rejected)")
    assert "2 rows" in line and 'train row 1: chosen="Put a pot' in line and "train row 4:" in line


def test_duplicate_pairs(tokenizer, tmp_path):
    train = pd.concat([pairs(4), pairs(1).assign(source_row=9)], ignore_index=True)
    err = failure(train, pairs(2, prefix="test"), tokenizer, tmp_path)
    line = failed_line(err, "expect_compound_columns_to_be_unique(prompt, chosen, rejected)")
    assert "2 rows" in line and "train row 1:" in line and "train row 9:" in line


def test_over_long_texts(tokenizer, tmp_path):
    train = pairs(4)
    train.loc[2, "chosen"] = "water " * 200
    train.loc[1, "prompt"] = "please " * 200
    err = failure(
        train,
        pairs(2, prefix="test"),
        tokenizer,
        tmp_path,
        max_response_tokens=64,
        max_prompt_tokens=64,
        overlong="fail",
    )
    line = failed_line(err, "expect_column_values_to_be_between(chosen_tokens)")
    assert "1 row" in line and "train row 3: chosen_tokens=" in line
    assert "train row 2: prompt_tokens=" in failed_line(err, "expect_column_values_to_be_between(prompt_tokens)")


def test_blank_and_over_long_rows_are_dropped_counted_and_kept_out(tokenizer, tmp_path):
    train = pairs(40)
    train.loc[3, "chosen"] = "water " * 200  # over-long response
    train.loc[7, "prompt"] = "please " * 200  # over-long prompt
    train.loc[9, "rejected"] = " \t"  # blank response
    result = run(
        train,
        pairs(10, start_row=101, prefix="test"),
        tokenizer,
        tmp_path,
        max_response_tokens=64,
        max_prompt_tokens=64,
        max_dropped_fraction=0.1,
    )
    assert result.success and result.dropped == {"train": [3, 7, 9]}
    assert result.dropped_per_reason == {"overlong_chosen": 1, "overlong_prompt": 1, "blank_rejected": 1}
    summary = result.summary()
    assert summary["validate/dropped_rows"] == 3 and summary["validate/dropped_fraction"] == 3 / 50
    assert summary["validate/dropped_overlong_prompt"] == 1 and summary["validate/dropped_blank_rejected"] == 1
    assert summary["validate/train_rows"] == 37 and summary["validate/train_rows_dropped"] == 3
    kept = result.kept("train", train)
    assert len(kept) == 37 and not {4, 8, 10} & set(kept["source_row"])  # rows are named by their input line
    report = json.loads((tmp_path / "validation.json").read_text())
    assert report["dropped"]["per_reason"] == result.dropped_per_reason
    page = (tmp_path / "validation.html").read_text()
    assert "Dropped rows: 3 of 50" in page and "dropped: train row 8:" in page


def test_too_many_dropped_rows_fail_naming_the_share_the_reasons_and_rows(tokenizer, tmp_path):
    train = pairs(20)
    train.loc[[2, 5], "chosen"] = "water " * 200
    err = failure(
        train, pairs(4, prefix="test"), tokenizer, tmp_path, max_response_tokens=64, max_dropped_fraction=0.05
    )
    line = failed_line(err, "max_dropped_fraction(rows)")
    assert "2 of 24 rows (8.3%) would be dropped, more than validate.max_dropped_fraction=0.05" in line
    assert "overlong_chosen: 2" in line and "train row 3:" in line and "train row 6:" in line
    assert err.result.summary()["validate/expectations_failed"] == 1  # only the share: the rows themselves may go


def test_too_short_responses_are_no_over_long_rows_and_still_fail(tokenizer, tmp_path):
    train = pairs(20)
    train.loc[4, "rejected"] = "N"
    err = failure(train, pairs(4, prefix="test"), tokenizer, tmp_path, min_tokens=2)
    line = failed_line(err, "expect_column_values_to_be_between(rejected_tokens)")
    assert "1 row with a rejected shorter than 2 or longer than 512 tokens — train row 5:" in line


def test_a_conversation_shared_by_the_judge_and_train_splits_fails(tokenizer, tmp_path):
    train, judge, test = pairs(5), pairs(3, start_row=20, prefix="judge"), pairs(3, start_row=50, prefix="test")
    judge.loc[0, "prompt"] = train.loc[2, "prompt"]
    with pytest.raises(DataValidationError) as err:
        validate_preferences(
            {"train": train, "judge": judge, "test": test},
            cfg=ValidateConfig(),
            tokenizer=tokenizer,
            report_dir=tmp_path,
        )
    line = failed_line(err.value, "expect_column_values_to_be_in_set(conversation_in_other_split)")
    assert "train row 3:" in line and "judge row 20:" in line


def test_conversations_leaking_between_train_and_test(tokenizer, tmp_path):
    train, test = pairs(5), pairs(3, start_row=50, prefix="test")
    test.loc[1, "prompt"] = train.loc[3, "prompt"]
    err = failure(train, test, tokenizer, tmp_path)
    line = failed_line(err, "expect_column_values_to_be_in_set(conversation_in_other_split)")
    assert "2 rows" in line and "train row 4:" in line and "test row 51:" in line


def test_wrong_types(tokenizer, tmp_path):
    train = pairs(4).astype({"chosen": object})
    train.loc[1, "chosen"] = 42
    train.loc[2, "chosen"] = ["a", "list"]
    err = failure(train, pairs(2, prefix="test"), tokenizer, tmp_path)
    line = failed_line(err, "expect_column_values_to_be_of_type(chosen)")
    assert "2 rows" in line and "train row 2: chosen=42" in line and "train row 3:" in line


def test_examples_are_limited_and_the_html_shows_failures(tokenizer, tmp_path):
    train = pairs(12)
    train["rejected"] = train["chosen"]
    err = failure(train, pairs(2, prefix="test"), tokenizer, tmp_path, examples_per_failure=3)
    line = failed_line(err, "expect_select_column_values_to_be_unique_within_record")
    assert "12 rows" in line and line.count("train row") == 3 and "and 9 more" in line
    assert err.result.summary()["validate/expectations_failed"] == 1
    page = (tmp_path / "validation.html").read_text()
    assert "Preference data validation: FAILED" in page and "train row 1:" in page


def test_rows_are_named_by_their_line_in_the_input_file(tokenizer, tmp_path):
    good = [json.dumps({"prompt": f"Question {i}?", "chosen": f"Answer {i}.", "rejected": "No."}) for i in range(6)]
    bad = json.dumps({"prompt": "Question 9?", "chosen": "Same.", "rejected": "Same."})
    path = tmp_path / "prefs.jsonl"
    path.write_text("\n".join(good[:4] + [bad] + good[4:]) + "\n")  # the bad pair is on line 5
    df = load_preferences(path)
    train, test = df[df["prompt"] != "Question 0?"], df[df["prompt"] == "Question 0?"]
    err = failure(train, test, tokenizer, tmp_path / "report")
    assert "train row 5:" in failed_line(err, "expect_select_column_values_to_be_unique_within_record")


def test_an_hh_format_file_with_over_long_and_blank_rows(tokenizer, tmp_path):
    def dialogue(question: str, answer: str) -> str:
        return f"\n\nHuman: {question}\n\nAssistant: {answer}"

    rows = [
        {
            "chosen": dialogue(f"How do I keep plant {i} alive?", f"Water plant {i} weekly."),
            "rejected": dialogue(f"How do I keep plant {i} alive?", "Plants are boring."),
        }
        for i in range(40)
    ]
    rows[3]["chosen"] = dialogue("How do I keep plant 3 alive?", "")  # the assistant said nothing
    rows[10] = {k: dialogue("please " * 100, v.split("Assistant: ")[-1]) for k, v in rows[10].items()}
    path = tmp_path / "hh.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    splits = assign_splits(load_preferences(path), test_fraction=0.2, judge_fraction=0.25, seed=0)

    result = validate_preferences(
        splits, cfg=ValidateConfig(max_prompt_tokens=64), tokenizer=tokenizer, report_dir=tmp_path / "ok"
    )
    assert result.dropped_per_reason == {"blank_chosen": 1, "overlong_prompt": 1}
    kept = {row for split, df in splits.items() for row in result.kept(split, df)["source_row"]}
    assert len(kept) == 38 and not {4, 11} & kept  # lines 4 and 11 of the file

    with pytest.raises(DataValidationError) as err:  # 2 of 40 rows is more than 2%
        validate_preferences(
            splits,
            cfg=ValidateConfig(max_prompt_tokens=64, max_dropped_fraction=0.02),
            tokenizer=tokenizer,
            report_dir=tmp_path / "failed",
        )
    line = failed_line(err.value, "max_dropped_fraction(rows)")
    assert "2 of 40 rows (5.0%)" in line and "blank_chosen: 1" in line and "overlong_prompt: 1" in line
    assert "row 4:" in line and "row 11:" in line
