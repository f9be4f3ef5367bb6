"""Reading preference data: every accepted format, and every structural problem named with its rows."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pandas as pd
import pytest

from rlhflow.data.formats import DataFormatError, load_preferences
from rlhflow.data.readers import read_jsonl, write_jsonl
from rlhflow.fsutil import MADE_MARKER, mark_made

SHIPPED_DATA = Path(__file__).resolve().parents[1] / "data"  # real preference data shipped with the project


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def row(prompt="What is 2+2?", chosen="It is 4.", rejected="No idea.") -> str:
    return json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}, ensure_ascii=False)


# ---- formats -------------------------------------------------------------------------------------------


def test_plain_jsonl_rows_are_numbered_by_line(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [row(), "", row(prompt="Hi", chosen="Hello!", rejected="Go away.")])
    with pytest.raises(DataFormatError, match=r"p.jsonl: 1 unreadable line\(s\) \(row 2\): line 2: blank"):
        load_preferences(str(path))  # a blank line is a bad line: a file of blank lines stops at the bound
    path = write_lines(tmp_path / "p.jsonl", [row(), row(prompt="Hi", chosen="Hello!", rejected="Go away.")])
    df = load_preferences(str(path))
    assert list(df.columns) == ["prompt", "prompt_messages", "chosen", "rejected", "source_row"]
    assert df["source_row"].tolist() == [1, 2]
    assert df.loc[1, "prompt"] == "Hi"
    assert df.loc[1, "prompt_messages"] == [{"role": "user", "content": "Hi"}]
    assert df.loc[1, ["chosen", "rejected"]].tolist() == ["Hello!", "Go away."]


def test_gzipped_jsonl_and_parquet(tmp_path):
    gz = tmp_path / "p.jsonl.gz"
    gz.write_bytes(gzip.compress((row() + "\n" + row(prompt="Q2") + "\n").encode()))
    assert load_preferences(gz)["prompt"].tolist() == ["What is 2+2?", "Q2"]

    parquet = tmp_path / "p.parquet"
    pd.DataFrame([json.loads(row()), json.loads(row(prompt="Q2", chosen=None))]).to_parquet(parquet)
    df = load_preferences(parquet)
    assert df["source_row"].tolist() == [1, 2]
    assert pd.isna(df.loc[1, "chosen"])  # a null is content: kept for the validation suite


def test_trl_conversational_json_list(tmp_path):
    records = [
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
            "chosen": [{"role": "assistant", "content": "Blue."}],
            "rejected": [{"role": "assistant", "content": "I won't."}],
        }
    ]
    path = tmp_path / "conv.json"
    path.write_text(json.dumps(records, indent=2))
    df = load_preferences(path)
    assert df.loc[0, "prompt_messages"] == records[0]["prompt"]
    assert df.loc[0, "prompt"] == "System: Be brief.\n\nHuman: Name a colour.\n\nAssistant:"
    assert (df.loc[0, "chosen"], df.loc[0, "rejected"]) == ("Blue.", "I won't.")


def test_anthropic_hh_dialogues(tmp_path):
    single = {
        "chosen": "\n\nHuman: How do I boil an egg?\n\nAssistant: Simmer it for 8 minutes.",
        "rejected": "\n\nHuman: How do I boil an egg?\n\nAssistant:  Figure it out. ",
    }
    multi = {
        "chosen": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Tell me a joke.\n\nAssistant: Why did the chicken...",
        "rejected": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Tell me a joke.\n\nAssistant: No.",
    }
    path = write_lines(tmp_path / "hh.jsonl", [json.dumps(single), json.dumps(multi)])
    df = load_preferences(path)
    assert df.loc[0, "prompt"] == "How do I boil an egg?"
    assert df.loc[0, "prompt_messages"] == [{"role": "user", "content": "How do I boil an egg?"}]
    assert (df.loc[0, "chosen"], df.loc[0, "rejected"]) == ("Simmer it for 8 minutes.", "Figure it out.")
    assert df.loc[1, "prompt_messages"] == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Tell me a joke."},
    ]
    assert df.loc[1, "prompt"] == "Human: Hi\n\nAssistant: Hello!\n\nHuman: Tell me a joke.\n\nAssistant:"
    assert df.loc[1, "rejected"] == "No."


def test_sharegpt_conversations(tmp_path):
    records = [
        {
            "conversations": [{"from": "human", "value": "Translate 'cat' to French."}],
            "chosen": {"from": "gpt", "value": "Chat."},
            "rejected": {"from": "gpt", "value": "Dog."},
        },
        {
            "system": "You are a tutor.",
            "conversations": [
                {"from": "human", "value": "2+2?"},
                {"from": "gpt", "value": "4."},
                {"from": "human", "value": "And 3+3?"},
            ],
            "chosen": {"from": "gpt", "value": "6."},
            "rejected": {"from": "gpt", "value": "7."},
        },
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))
    df = load_preferences(path)
    assert df.loc[0, "prompt"] == "Translate 'cat' to French."
    assert df.loc[1, "prompt_messages"][0] == {"role": "system", "content": "You are a tutor."}
    assert [m["role"] for m in df.loc[1, "prompt_messages"]] == ["system", "user", "assistant", "user"]
    assert df["chosen"].tolist() == ["Chat.", "6."]


def test_dataset_saved_to_disk_and_directory_of_files(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    records = [json.loads(row(prompt=f"Q{i}")) for i in range(3)]

    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "single"))
    assert load_preferences(str(tmp_path / "single"))["prompt"].tolist() == ["Q0", "Q1", "Q2"]

    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(records), "test": datasets.Dataset.from_list(records[:1])}
    ).save_to_disk(str(tmp_path / "dd"))
    assert len(load_preferences(str(tmp_path / "dd"), hf_split="test")) == 1
    with pytest.raises(DataFormatError, match="no split 'validation'; splits found: train, test"):
        load_preferences(str(tmp_path / "dd"), hf_split="validation")

    files = tmp_path / "files"
    files.mkdir()
    write_lines(files / "train.jsonl", [json.dumps(r) for r in records])
    df = load_preferences(str(files))
    assert df["prompt"].tolist() == ["Q0", "Q1", "Q2"] and df["source_row"].tolist() == [1, 2, 3]


def test_a_name_that_is_not_a_path_goes_to_the_hub_loader(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list([json.loads(row())])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    df = load_preferences("someone/prefs", hf_split="test[:10]")
    assert calls == [("someone/prefs", "test[:10]")] and len(df) == 1


def test_content_problems_are_kept_for_the_validation_suite(tmp_path):
    path = write_lines(
        tmp_path / "p.jsonl",
        [
            row(chosen=None),
            row(chosen=""),
            row(chosen="same", rejected="same"),
            row(),
            row(),
        ],
    )
    df = load_preferences(path)
    assert len(df) == 5 and pd.isna(df.loc[0, "chosen"]) and df.loc[1, "chosen"] == ""


def test_real_hh_rlhf_file():
    df = load_preferences(SHIPPED_DATA / "hh-rlhf-harmless" / "harmless-base.jsonl.gz")
    assert len(df) == 1500
    assert df["prompt_messages"].map(lambda m: m[0]["role"] == "user" and m[-1]["role"] == "user").all()
    assert not df["chosen"].str.contains("\n\nAssistant:").all()
    assert df["prompt"].map(lambda p: isinstance(p, str) and p.strip() != "").all()


def test_real_sharegpt_file():
    df = load_preferences(SHIPPED_DATA / "llamafactory-dpo-en" / "dpo_en_demo.json")
    assert len(df) == 300
    assert df["source_row"].tolist() == list(range(1, 301))
    assert df["chosen"].map(lambda t: isinstance(t, str) and t.strip() != "").all()
    assert df["prompt_messages"].map(lambda m: m[-1]["role"] == "user").all()


# ---- structural problems --------------------------------------------------------------------------------


def test_invalid_json_names_the_lines(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", [row(), row(), '{"prompt": "x", "chosen": ', row(), "[1, 2]"])
    with pytest.raises(DataFormatError) as err:
        load_preferences(path)
    message = str(err.value)
    assert str(path) in message and "(rows 3, 5)" in message
    assert "line 3: invalid JSON" in message and "line 5: expected a JSON object, got list" in message


def test_invalid_json_in_a_json_list_names_the_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"prompt": "a", "chosen": "b", "rejected": "c"},\n  {"prompt": "a" "chosen": "b"}\n]')
    with pytest.raises(DataFormatError, match=r"invalid JSON on line 3: .*item 2"):
        load_preferences(path)


def test_wrong_encoding_names_line_and_byte(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes((row() + "\n" + row(prompt="Café?") + "\n").encode("latin-1"))
    with pytest.raises(DataFormatError) as err:
        load_preferences(path)
    first_line_bytes = len(row()) + 1
    offset = first_line_bytes + row(prompt="Café?").encode("latin-1").index(b"\xe9")
    assert f"line 2: not UTF-8 (byte 0xe9 at byte offset {offset})" in str(err.value)

    as_list = tmp_path / "latin1.json"
    as_list.write_bytes(("[\n" + row() + ",\n" + row(prompt="Café?") + "\n]").encode("latin-1"))
    with pytest.raises(DataFormatError, match=r"not UTF-8: byte 0xe9 at byte offset \d+ \(line 3\)"):
        load_preferences(as_list)


@pytest.mark.parametrize("content", [b"", b"\n\n  \n", b"[]", b"[\n]\n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataFormatError, match="empty file"):
        load_preferences(path)


def test_unrecognised_schema_lists_columns_and_formats(tmp_path):
    path = write_lines(tmp_path / "alpaca.jsonl", [json.dumps({"instruction": "a", "input": "", "output": "b"})])
    with pytest.raises(DataFormatError) as err:
        load_preferences(path)
    message = str(err.value)
    assert "unrecognised schema" in message and "columns found: instruction, input, output" in message
    assert "prompt/chosen/rejected" in message and "sharegpt" in message and "HH" in message


def test_missing_column_is_an_unrecognised_schema(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [json.dumps({"prompt": "a", "chosen": "b"})])
    with pytest.raises(DataFormatError, match="columns found: prompt, chosen"):
        load_preferences(path)


def test_wrong_types_name_column_and_rows(tmp_path):
    path = write_lines(
        tmp_path / "p.jsonl",
        [
            row(),
            row(chosen=3),
            row(),
            row(chosen={"text": "x"}),
            row(rejected=True),
            row(prompt=[1, 2]),
        ],
    )
    with pytest.raises(DataFormatError) as err:
        load_preferences(path)
    message = str(err.value)
    assert "column chosen: got dict/int, expected text or a list of messages (rows 2, 4)" in message
    assert "column rejected: got bool, expected text or a list of messages (row 5)" in message
    assert "column prompt: got int, expected messages with role/content (row 6)" in message


def test_hh_rows_without_a_shared_prompt_are_named(tmp_path):
    path = write_lines(
        tmp_path / "hh.jsonl",
        [
            json.dumps({"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: a\n\nAssistant: c"}),
            json.dumps({"chosen": "just an answer", "rejected": "another answer"}),
        ],
    )
    with pytest.raises(DataFormatError, match=r"do not share a prompt .* \(row 2\)"):
        load_preferences(path)


def test_more_rows_than_max_rows_stops_early(tmp_path):
    lines = [row(prompt=f"Q{i}") for i in range(5)] + ["this line is never parsed"]
    path = write_lines(tmp_path / "big.jsonl", lines)
    with pytest.raises(DataFormatError, match=r"more than max_rows=3 rows \(stopped reading at line 4\)"):
        load_preferences(path, max_rows=3)
    assert len(load_preferences(write_lines(tmp_path / "ok.jsonl", lines[:3]), max_rows=3)) == 3

    as_list = tmp_path / "big.json"
    as_list.write_text("[" + ",".join(lines[:5]) + ", this is never parsed")
    with pytest.raises(DataFormatError, match=r"more than max_rows=3 rows \(stopped reading at item 4\)"):
        load_preferences(as_list, max_rows=3)

    parquet = tmp_path / "big.parquet"
    pd.DataFrame([json.loads(line) for line in lines[:5]]).to_parquet(parquet)
    with pytest.raises(DataFormatError, match="more than max_rows=3"):
        load_preferences(parquet, max_rows=3)


def test_missing_file(tmp_path):
    with pytest.raises(DataFormatError, match="no such file"):
        load_preferences(str(tmp_path / "nope.jsonl"))


# ---- writing and reading splits ---------------------------------------------------------------------------


def test_write_and_read_jsonl_round_trip(tmp_path):
    df = load_preferences(write_lines(tmp_path / "p.jsonl", [row(), row(prompt="Café ☕")]))
    (tmp_path / "splits").mkdir()
    mark_made(tmp_path / "splits", "validate.out_dir")  # as the stage's output directory is: no record needed
    out = write_jsonl(df, tmp_path / "splits" / "train.jsonl")
    assert sorted(p.name for p in out.parent.iterdir()) == [MADE_MARKER, "train.jsonl"]  # no temp file left behind
    back = read_jsonl(out)
    assert back["prompt_messages"].tolist() == df["prompt_messages"].tolist()
    assert back["prompt"].tolist() == ["What is 2+2?", "Café ☕"] and back["source_row"].tolist() == [1, 2]
    assert json.loads(out.read_text(encoding="utf-8").splitlines()[1])["prompt_messages"][0]["content"] == "Café ☕"
