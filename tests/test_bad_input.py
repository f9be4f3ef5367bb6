"""Bad input through the real Prefect flow: each kind of bad data is rejected by the validate stage with a
message naming the problem and the rows; no later stage runs, nothing is registered, the MLflow parent run is
FAILED and the previous good outputs on disk stay byte for byte as they were. Bad parameters fail before any
work starts, naming the key, through the flow and through the CLIs."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, tiny_pipeline_overrides

N_ROWS = 40
GOOD_OUTPUTS = ("data/validated", "reports/validation", "models/sft", "metrics")


def row(i: int, **changes) -> dict:
    base = {
        "prompt": f"How do I look after plant number {i}?",
        "chosen": f"Water plant {i} once a week and give it some light.",
        "rejected": "Plants are boring.",
    }
    return {**base, **changes}


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# Each case writes its bad input under `d` and returns (extra --set values, patterns the error must contain).
def missing_column(d):
    rows = [{k: v for k, v in row(i).items() if k != "rejected"} for i in range(N_ROWS)]
    return [f"data.preferences={write_rows(d / 'p.jsonl', rows)}"], [r"missing column rejected in all 40 rows"]


def nulls(d):
    rows = [row(i, chosen=None) if i in (2, 6) else row(i) for i in range(N_ROWS)]  # lines 3 and 7
    return [f"data.preferences={write_rows(d / 'p.jsonl', rows)}"], [
        r"expect_column_values_to_not_be_null\(chosen\): 2 rows",
        r"(train|judge|dev|test) row 3:",
        r"(train|judge|dev|test) row 7:",
    ]


def empty_strings(d):  # with validate.blank=fail: listed, not dropped
    rows = [row(i, rejected="") if i == 4 else row(i, prompt="   ") if i == 8 else row(i) for i in range(N_ROWS)]
    return [f"data.preferences={write_rows(d / 'p.jsonl', rows)}", "validate.blank=fail"], [
        r"expect_column_values_to_not_match_regex\(rejected\): 1 row with a blank rejected \(empty or whitespace "
        r"only\) — (train|judge|dev|test) row 5:",
        r"expect_column_values_to_not_match_regex\(prompt\): 1 row with a blank prompt \(empty or whitespace only\) "
        r"— (train|judge|dev|test) row 9:",
    ]


def chosen_equal_to_rejected(d):
    rows = [row(i, rejected=row(i)["chosen"]) if i in (1, 3) else row(i) for i in range(N_ROWS)]
    return [f"data.preferences={write_rows(d / 'p.jsonl', rows)}"], [
        r"unique_within_record\(chosen, rejected\): 2 rows",
        r"(train|judge|dev|test) row 2:",
        r"(train|judge|dev|test) row 4:",
    ]


def duplicate_pairs(d):
    rows = [row(i) for i in range(N_ROWS)] + [row(10)]  # line 41 repeats line 11
    return [f"data.preferences={write_rows(d / 'p.jsonl', rows)}"], [
        r"compound_columns_to_be_unique\(prompt, chosen, rejected\): 2 rows",
        r"row 11:",
        r"row 41:",
    ]


def invalid_json_line(d):
    lines = [json.dumps(row(i)) for i in range(N_ROWS)]
    lines[5] = '{"prompt": "cut off", "chosen": '
    (d / "p.jsonl").write_text("\n".join(lines) + "\n")
    return [f"data.preferences={d / 'p.jsonl'}"], [r"unreadable line\(s\) \(row 6\)", r"line 6: invalid JSON"]


def wrong_encoding(d):
    lines = [json.dumps(row(i), ensure_ascii=False).encode("utf-8") for i in range(N_ROWS)]
    lines[2] = json.dumps(row(2, chosen="Un café, s'il vous plaît."), ensure_ascii=False).encode("latin-1")
    (d / "p.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return [f"data.preferences={d / 'p.jsonl'}"], [r"line 3: not UTF-8 \(byte 0xe9"]


def over_long_texts(d):  # with validate.overlong=fail: listed, not dropped
    rows = [row(i, chosen="water the plant " * 300) if i == 7 else row(i) for i in range(N_ROWS)]
    return [f"data.preferences={write_rows(d / 'p.jsonl', rows)}", "validate.overlong=fail"], [
        r"expect_column_values_to_be_between\(chosen_tokens\): 1 row with a chosen shorter than 1 or longer than "
        r"512 tokens — (train|judge|dev|test) row 8: chosen_tokens="
    ]


def too_many_over_long_texts(d):  # dropped by default, but 4 of 40 rows is more than max_dropped_fraction
    rows = [row(i, prompt="water the plant " * 300) if i in (2, 11, 20, 33) else row(i) for i in range(N_ROWS)]
    return [f"data.preferences={write_rows(d / 'p.jsonl', rows)}"], [
        r"max_dropped_fraction\(rows\): 4 of 40 rows \(10\.0%\) would be dropped, more than "
        r"validate\.max_dropped_fraction=0\.05 \(overlong_prompt: 4\)",
        r"row 3: prompt_tokens=",
        r"row 34:",
    ]


def wrong_types(d):
    rows = [row(i, chosen=42) if i == 3 else row(i, rejected=True) if i == 5 else row(i) for i in range(N_ROWS)]
    return [f"data.preferences={write_rows(d / 'p.jsonl', rows)}"], [
        r"values of the wrong type",
        r"column chosen: got int, expected .* \(row 4\)",
        r"column rejected: got bool, expected .* \(row 6\)",
    ]


def empty_file(d):
    (d / "p.jsonl").write_bytes(b"")
    return [f"data.preferences={d / 'p.jsonl'}"], [r"empty file: no rows to read"]


def huge_file_over_max_rows(d):
    # 200,000 lines whose last one is broken: reading it all would report that line; stopping at the limit does not
    line = json.dumps(row(0)) + "\n"
    with open(d / "p.jsonl", "w") as f:
        f.write(line * 199_999 + "{broken\n")
    return [f"data.preferences={d / 'p.jsonl'}", "validate.max_rows=1000"], [
        r"more than max_rows=1000 rows \(stopped reading at line 1001\)"
    ]


def not_a_preference_file(d):
    (d / "p.csv").write_text("prompt,chosen,rejected\nhi,hello,go away\n")
    return [f"data.preferences={d / 'p.csv'}"], [r"not a preference file: it starts with 'p'"]


def missing_file(d):
    return [f"data.preferences={d / 'nowhere.jsonl'}"], [r"nowhere\.jsonl: no such file or directory"]


def broken_json_list(d):
    text = "[\n" + ",\n".join(json.dumps(row(i)) for i in range(4)) + ',\n{"prompt": oops}\n]\n'
    (d / "p.json").write_text(text)
    return [f"data.preferences={d / 'p.json'}"], [r"invalid JSON on line 6"]


def write_gzipped_long_line(path: Path, line_bytes: int) -> Path:
    """A .jsonl.gz whose line 1 is a good row and line 2 `line_bytes` zeros: gzip members of 64 MiB of zeros one after
    another (one valid gzip file, about 1 MB on disk per GiB of zeros)."""
    zeros = gzip.compress(b"0" * (64 << 20), compresslevel=9)
    with open(path, "wb") as f:
        f.write(gzip.compress((json.dumps(row(0)) + "\n").encode()))
        for _ in range(line_bytes // (64 << 20)):
            f.write(zeros)
        f.write(gzip.compress(b"\n"))
    return path


def gzipped_gigabyte_line(d):
    path = write_gzipped_long_line(d / "p.jsonl.gz", 1 << 30)
    return [f"data.preferences={path}"], [r"p\.jsonl\.gz: line 2 is longer than 16777216 bytes"]


CASES = [
    missing_column,
    nulls,
    empty_strings,
    chosen_equal_to_rejected,
    duplicate_pairs,
    invalid_json_line,
    wrong_encoding,
    over_long_texts,
    too_many_over_long_texts,
    wrong_types,
    empty_file,
    huge_file_over_max_rows,
    not_a_preference_file,
    missing_file,
    broken_json_list,
    gzipped_gigabyte_line,
]


def tree_digest(root: Path) -> dict[str, str]:
    """md5 of every file under the good outputs, by relative path. The flow's hash cache (metrics/.flow/hash-state,
    DVC's state db of inode/mtime -> md5) is no output: hashing the bad file adds an entry to it."""
    out = {}
    for rel in GOOD_OUTPUTS:
        for p in sorted((root / rel).rglob("*")):
            if p.is_file() and "hash-state" not in p.relative_to(root).parts:
                out[str(p.relative_to(root))] = hashlib.md5(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def good_run(prefect_server, tmp_path_factory, tiny_model_dir):
    """A tmp project whose demo data went through validate and sft: the previous good outputs."""
    from flows.pipeline import rlhf_pipeline

    root = tmp_path_factory.mktemp("project")
    rlhf_pipeline(
        overrides=tiny_pipeline_overrides(root, tiny_model_dir) + ["tracking.log_models=false"],
        stages=["demo_data", "validate", "sft"],
    )
    before = tree_digest(root)
    assert any(k.startswith("models/sft/") for k in before) and "data/validated/train.jsonl" in before
    return root, before


@pytest.mark.system
@pytest.mark.parametrize("make_case", CASES, ids=[c.__name__ for c in CASES])
def test_bad_data_is_rejected_by_validate_and_nothing_else_happens(make_case, good_run, tiny_model_dir, tmp_path):
    import mlflow

    from flows.pipeline import rlhf_pipeline

    root, before = good_run
    extra, patterns = make_case(tmp_path)
    experiment = f"bad-{make_case.__name__}"
    overrides = tiny_pipeline_overrides(root, tiny_model_dir) + extra + [f"tracking.experiment={experiment}"]
    start = time.perf_counter()
    with pytest.raises(ValueError) as err:
        rlhf_pipeline(overrides=overrides)
    elapsed = time.perf_counter() - start
    message = str(err.value)
    for pattern in patterns:
        assert re.search(pattern, message), f"{pattern!r} not in:\n{message}"

    client = mlflow.MlflowClient(f"sqlite:///{root}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert sorted(r.data.tags.get("stage", "pipeline") for r in runs) == ["pipeline", "validate"]  # no later stage
    assert all(r.info.status == "FAILED" for r in runs)
    assert all(message.splitlines()[0][:200] in r.data.tags["error"] for r in runs if "stage" in r.data.tags)
    assert client.search_registered_models() == []
    assert tree_digest(root) == before  # validated splits, their report, the SFT model, metrics: untouched
    assert not (root / "models/reward_model").exists() and not (root / "models/policy").exists()
    if make_case is huge_file_over_max_rows:
        assert elapsed < 30, f"{elapsed:.1f}s: the row limit should stop reading early"


# ---- bad parameters: fail before any work, naming the key -----------------------------------------------

BAD_PARAMS = [
    ("ppo.no_such_knob=1", r"unknown parameter 'ppo.no_such_knob'"),
    ("reward_model.batch_size=sixteen", r"parameter 'reward_model.batch_size': .*integer"),
    ("validate.test_fraction=1.5", r"parameter 'validate.test_fraction': .*less than 1"),
]


@pytest.mark.system
@pytest.mark.parametrize("override,pattern", BAD_PARAMS, ids=["unknown_key", "wrong_type", "out_of_range"])
def test_bad_parameters_fail_the_flow_before_any_work(override, pattern, prefect_server, tmp_path, tiny_model_dir):
    from flows.pipeline import rlhf_pipeline
    from rlhflow.config.params import ConfigError

    with pytest.raises(ConfigError, match=pattern):
        rlhf_pipeline(overrides=tiny_pipeline_overrides(tmp_path, tiny_model_dir) + [override])
    assert list(tmp_path.iterdir()) == []  # no MLflow store, no data, no outputs


@pytest.mark.parametrize("module", ["tasks.validate", "flows.pipeline"])
@pytest.mark.system
def test_bad_parameters_fail_the_cli_before_any_work(module, tmp_path, tiny_model_dir):
    """All three kinds at once: the error lists each key (exit status 2, no traceback, nothing written)."""
    overrides = tiny_pipeline_overrides(tmp_path, tiny_model_dir) + [override for override, _ in BAD_PARAMS]
    args = [a for o in overrides for a in ("--set", o)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stdout + done.stderr
    for _, pattern in BAD_PARAMS:
        assert re.search(pattern, done.stderr), done.stderr
    assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


# ---- bounded reading: a line or a file past the readers' limits fails early, in bounded memory --------------

MEMORY_PROBE = """
import resource, sys
from pathlib import Path
from rlhflow.data.errors import DataFormatError
from rlhflow.data.readers import read_rows

before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    read_rows(Path(sys.argv[1]))
except DataFormatError as err:
    print(err)
print("peak growth KiB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


@pytest.mark.system
@pytest.mark.parametrize("given", ["file", "directory"])
def test_a_gigabyte_line_in_a_small_gzip_fails_naming_file_and_line_in_bounded_memory(given, tmp_path):
    """Named as a file, or as a dataset directory holding it (read file by file by the same readers, not
    converted by Hugging Face's loader first)."""
    from rlhflow.data.readers import MAX_LINE_BYTES

    (tmp_path / "data").mkdir()
    path = write_gzipped_long_line(tmp_path / "data" / "train.jsonl.gz", 1 << 30)
    assert path.stat().st_size < 2 << 20  # about 1 MB on disk for 1 GiB of line
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    named = path if given == "file" else path.parent
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(named)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert f"{path}: line 2 is longer than {MAX_LINE_BYTES} bytes" in done.stdout, done.stdout
    growth_mib = int(done.stdout.rsplit("peak growth KiB", 1)[1]) / 1024
    assert growth_mib < 4 * MAX_LINE_BYTES / 2**20, f"reading grew the process by {growth_mib:.0f} MiB"


def test_a_json_list_item_past_the_line_limit_fails_naming_file_and_line(tmp_path):
    from rlhflow.data.errors import DataFormatError
    from rlhflow.data.readers import MAX_LINE_BYTES, read_file

    path = tmp_path / "p.json"
    path.write_text("[\n" + json.dumps(row(0)) + ',\n{"prompt": "' + "a" * MAX_LINE_BYTES + '"}\n]\n')
    with pytest.raises(DataFormatError, match=r"p\.json: invalid JSON on line 3: item 2 is longer than"):
        read_file(path, None)


def test_a_file_past_the_decompressed_limit_fails_naming_file_and_line(tmp_path, monkeypatch):
    """Without validate.max_rows, rows of any number read on: the decompressed size stops them."""
    from rlhflow.data import readers
    from rlhflow.data.errors import DataFormatError

    monkeypatch.setattr(readers, "MAX_DECOMPRESSED_BYTES", 1 << 20)  # 1 MiB: the same check as 4 GiB, sooner
    path = tmp_path / "p.jsonl.gz"
    path.write_bytes(gzip.compress((json.dumps(row(0)) + "\n").encode() + (b'{"pad": "' + b"x" * 989 + b'"}\n') * 4096))
    first = len(json.dumps(row(0))) + 1
    stop = (readers.MAX_DECOMPRESSED_BYTES - first) // 1001 + 2  # the line whose bytes pass the limit
    with pytest.raises(
        DataFormatError, match=rf"p\.jsonl\.gz: more than 1048576 bytes once decompressed .*line {stop}\b"
    ):
        readers.read_file(path, None)


def _malformed_files(good: str) -> dict[str, bytes]:
    """Name -> content of a file each reader must refuse with the project's error: cut, deep, wrong type, not UTF-8,
    a line past the (lowered) line limit, binary noise."""
    deep = '{"prompt": "p", "x": ' + "[" * 40 + "]" * 40 + "}"
    deeper = '{"prompt": "p", "x": ' + "[" * 200_000 + "]" * 200_000 + "}"  # past Python's recursion limit
    return {
        "cut": (good + "\n" + good[: len(good) // 2] + "\n").encode(),
        "deep": (good + "\n" + deep + "\n").encode(),
        "deeper": (good + "\n" + deeper + "\n").encode(),
        "a_list": (good + "\n[1, 2]\n").encode(),
        "not_utf8": (good + "\n").encode() + b'{"prompt": "\xff\xfe"}\n',
        "long_line": (good + "\n" + json.dumps({"prompt": "a" * (1 << 20)}) + "\n").encode(),
        "noise": bytes(range(256)) * 8,
    }


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".json", "feedback"])
def test_every_reader_refuses_malformed_and_oversized_files_with_its_own_error(suffix, tmp_path, monkeypatch):
    """Fuzz-style: each input reader (JSONL plain and gzipped, a JSON list, the feedback round's files) fed cut,
    deeply nested, wrongly typed, undecodable, overlong and random files raises only the project's error, naming the
    file and the row or line, never a traceback of another kind (RecursionError, UnicodeDecodeError...)."""
    from rlhflow.data import readers
    from rlhflow.data.errors import DataFormatError
    from rlhflow.data.feedback import FeedbackError, read_records

    monkeypatch.setattr(readers, "MAX_LINE_BYTES", 1 << 20)  # the same check as 16 MiB, on smaller files
    good = json.dumps(row(0))
    for name, content in _malformed_files(good).items():
        if suffix == ".json":  # the same records as items of a list
            lines = content.split(b"\n")
            content = b"[" + b",\n".join(line for line in lines if line) + b"]" if name != "noise" else content
        path = tmp_path / f"{name}{'.jsonl' if suffix == 'feedback' else suffix}"
        path.write_bytes(gzip.compress(content) if suffix == ".jsonl.gz" else content)
        with pytest.raises((DataFormatError, FeedbackError)) as refused:
            if suffix == "feedback":
                read_records(path, ["prompt"])
            else:
                readers.read_file(path, None)
        message = str(refused.value)
        where = r"\b(line|item|row)s? \d|not a preference file: it starts with"  # noise: refused at its first byte
        assert str(path) in message and re.search(where, message), (name, message)
        assert len(message) < 2000, (name, "an error that echoes the file")
        if name.startswith("deep"):
            assert "MAX_NESTING" in message, message


@pytest.mark.parametrize("line", [b"{x\n", b"\n", b" \t\n"], ids=["invalid", "blank", "whitespace"])
@pytest.mark.parametrize("reader", ["jsonl", "feedback"])
def test_a_file_of_unreadable_lines_stops_at_the_bad_line_limit_naming_the_first(reader, line, tmp_path):
    """A small gzip can hold millions of unreadable lines, blank ones too: the read stops at the MAX_BAD_LINES-th
    (past it, a line that would fail otherwise is never reached)."""
    from rlhflow.data import readers
    from rlhflow.data.errors import DataFormatError
    from rlhflow.data.feedback import FeedbackError, read_records

    path = tmp_path / "p.jsonl.gz"
    good = b'{"prompt": "p", "chosen": "c", "rejected": "r"}\n'
    path.write_bytes(gzip.compress(good + line * readers.MAX_BAD_LINES + b"\xff" * (readers.MAX_LINE_BYTES + 1)))
    with pytest.raises((DataFormatError, FeedbackError)) as refused:
        read_records(path, ["prompt"]) if reader == "feedback" else readers.read_file(path, None)
    message = str(refused.value)
    assert f"stopped reading at line {readers.MAX_BAD_LINES + 1}," in message, message
    assert f"{path}: {readers.MAX_BAD_LINES} unreadable line(s) (rows 2, 3, 4" in message, message
    assert len(message) < 2000


@pytest.mark.parametrize("suffix", [".jsonl", ".json", "feedback"])
def test_a_number_past_pythons_limit_fails_naming_file_and_line(suffix, tmp_path):
    """An integer of 5,000 digits is valid JSON that Python refuses to read (its digit limit): a bad line of the
    file, named, not a ValueError naming nothing."""
    from rlhflow.data import readers
    from rlhflow.data.errors import DataFormatError
    from rlhflow.data.feedback import FeedbackError, read_records

    record = '{"prompt": "p", "chosen": "c", "rejected": "r", "n": ' + "9" * 5000 + "}"
    path = tmp_path / ("p.json" if suffix == ".json" else "p.jsonl")
    path.write_text(f"[\n{record}]" if suffix == ".json" else f'{{"prompt": "ok"}}\n{record}\n')
    with pytest.raises((DataFormatError, FeedbackError), match=rf"{re.escape(str(path))}: .*line 2.*past Python"):
        read_records(path, ["prompt"]) if suffix == "feedback" else readers.read_file(path, None)


def _parquet(path: Path, table_or_rows, **options) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = table_or_rows if isinstance(table_or_rows, pa.Table) else pa.Table.from_pylist(table_or_rows)
    pq.write_table(table, path, **options)
    return path


def test_parquet_columns_and_nesting_are_bounded_before_its_data_is_read(tmp_path, monkeypatch):
    import pyarrow as pa

    from rlhflow.data import readers
    from rlhflow.data.errors import DataFormatError

    deep = pa.array([[0]])
    for _ in range(readers.MAX_NESTING):
        deep = pa.array([[None]], type=pa.list_(deep.type))
    path = _parquet(tmp_path / "deep.parquet", pa.table({"prompt": ["p"], "x": deep}))
    with pytest.raises(DataFormatError, match=r"deep\.parquet: its columns nest .* deeper than 32 levels"):
        readers.read_file(path, None)
    monkeypatch.setattr(readers, "MAX_COLUMNS", 8)  # the same check as 1024, on a smaller file
    path = _parquet(tmp_path / "wide.parquet", [{f"c{i}": "v" for i in range(9)}])
    with pytest.raises(DataFormatError, match=r"wide\.parquet: more than MAX_COLUMNS=8 columns"):
        readers.read_file(path, None)
    path = _parquet(tmp_path / "eight.parquet", [{"prompt": "p", "messages": [{"role": "user", "content": "p"}]}])
    assert readers.read_file(path, None) == [(1, {"prompt": "p", "messages": [{"role": "user", "content": "p"}]})]


def test_a_parquet_value_past_the_line_limit_fails_naming_file_column_and_rows(tmp_path, monkeypatch):
    """Refused from the footer's sizes when a chunk must hold one (a one-row file), else before its batch of rows
    becomes Python objects; nested values too."""
    from rlhflow.data import readers
    from rlhflow.data.errors import DataFormatError

    monkeypatch.setattr(readers, "MAX_LINE_BYTES", 1 << 16)  # the same check as 16 MiB, on smaller files
    big = "a" * (readers.MAX_LINE_BYTES + 1)
    one = _parquet(tmp_path / "one.parquet", [{"prompt": big}], compression="gzip")
    assert one.stat().st_size < readers.MAX_LINE_BYTES  # small on disk, long once decompressed
    many = [{"prompt": f"p{i}", "messages": [{"role": "user", "content": "hi"}]} for i in range(2000)]
    many[1500]["messages"][0]["content"] = big
    nested = _parquet(tmp_path / "nested.parquet", many)
    for path, where in ((one, r"column 'prompt' .* in rows 1 to 1"), (nested, r"column 'messages' .* in rows 1025 ")):
        with pytest.raises(DataFormatError, match=rf"{path.name}: {where}"):
            readers.read_file(path, None)


def test_parquet_past_the_decompressed_limit_fails_before_its_rows_are_read(tmp_path, monkeypatch):
    from rlhflow.data import readers
    from rlhflow.data.errors import DataFormatError

    monkeypatch.setattr(readers, "MAX_DECOMPRESSED_BYTES", 1 << 16)  # the same check as 4 GiB, sooner
    path = _parquet(tmp_path / "p.parquet", [row(i) for i in range(2000)])
    with pytest.raises(DataFormatError, match=r"p\.parquet: \d+ bytes once decompressed, more than 65536"):
        readers.read_file(path, None)


def test_a_directory_of_data_files_is_read_file_by_file_by_split(tmp_path, monkeypatch):
    """A directory's files, by the split their names give (every file is train without one); a file of another kind
    is named, never handed to another loader; max_rows counts across the files."""
    import datasets

    from rlhflow.data import readers
    from rlhflow.data.errors import DataFormatError

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("Hugging Face's loader was called"))
    (tmp_path / "d" / "data").mkdir(parents=True)
    write_rows(tmp_path / "d" / "data" / "train-00000.jsonl", [row(0), row(1)])
    write_rows(tmp_path / "d" / "data" / "train-00001.jsonl", [row(2)])
    write_rows(tmp_path / "d" / "test.jsonl", [row(3)])
    assert [n for n, _ in readers.read_rows(tmp_path / "d")] == [1, 2, 3]
    assert [r["prompt"] for _, r in readers.read_rows(tmp_path / "d", hf_split="test")] == [row(3)["prompt"]]
    with pytest.raises(DataFormatError, match=r"d: no split 'validation'; splits found: test, train"):
        readers.read_rows(tmp_path / "d", hf_split="validation")
    with pytest.raises(DataFormatError, match=r"d: more than max_rows=2 rows"):
        readers.read_rows(tmp_path / "d", max_rows=2)
    (tmp_path / "d" / "notes.csv").write_text("prompt,chosen\n")
    with pytest.raises(DataFormatError, match=r"d: a data directory holds .* files only; found notes.csv"):
        readers.read_rows(tmp_path / "d")


def test_a_dataset_directory_is_held_to_the_same_bounds(tmp_path, monkeypatch):
    import datasets

    from rlhflow.data import readers
    from rlhflow.data.errors import DataFormatError

    monkeypatch.setattr(readers, "MAX_LINE_BYTES", 1 << 16)  # the same check as 16 MiB, on smaller files
    rows = [row(i) for i in range(3)]
    rows[2]["chosen"] = "a" * (readers.MAX_LINE_BYTES + 1)
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "ds")
    with pytest.raises(
        DataFormatError, match=r"ds: column 'chosen' holds a value longer than 65536 bytes .* rows 1 to 3"
    ):
        readers.read_rows(tmp_path / "ds")
