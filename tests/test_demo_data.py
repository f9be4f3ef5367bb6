"""The demo preference data: deterministic, varied, and clean enough to pass the validation suite."""

from __future__ import annotations

import pytest

from rlhflow.config.params import DemoDataConfig, ValidateConfig
from rlhflow.data.demo import REJECTION_KINDS, generate_demo, main, write_demo
from rlhflow.data.formats import load_preferences
from rlhflow.data.splits import split_by_conversation
from rlhflow.data.validation import validate_preferences
from tests.fixtures import tiny_tokenizer


def test_same_seed_same_data_other_seed_other_data():
    assert generate_demo(60, 2, seed=3) == generate_demo(60, 2, seed=3)
    assert generate_demo(60, 2, seed=3) != generate_demo(60, 2, seed=4)


def test_default_size_has_distinct_prompts_and_clear_pairs():
    pairs = generate_demo(480, 2, seed=0)
    assert len(pairs) == 960
    assert len({p["prompt"] for p in pairs}) == 480
    assert all(p["chosen"] != p["rejected"] for p in pairs)
    assert len({(p["prompt"], p["chosen"], p["rejected"]) for p in pairs}) == len(pairs)
    assert max(len(p["chosen"].split()) for p in pairs) <= 70  # the policy only writes ~48 tokens
    assert all(
        set(p) == {"prompt", "chosen", "rejected"} and all(isinstance(v, str) for v in p.values()) for p in pairs
    )
    # Rejected answers fall short in different ways, so some are longer than the chosen one.
    assert any(len(p["rejected"]) > len(p["chosen"]) for p in pairs)
    assert any(len(p["rejected"]) < len(p["chosen"]) / 3 for p in pairs)


def test_pairs_per_prompt_beyond_the_rejection_kinds_stay_unique():
    k = len(REJECTION_KINDS) + 2
    pairs = generate_demo(12, k, seed=0)
    assert len(pairs) == 12 * k and len({tuple(p.values()) for p in pairs}) == len(pairs)


def test_too_many_prompts_is_refused():
    with pytest.raises(ValueError, match="distinct prompts"):
        generate_demo(10**6, 1, seed=0)


def test_written_demo_reads_back_and_passes_validation(tmp_path):
    cfg = DemoDataConfig(n_prompts=480, pairs_per_prompt=2, seed=0)
    path = write_demo(cfg, tmp_path / "demo")
    assert path == tmp_path / "demo" / "preferences.jsonl"
    df = load_preferences(path)
    assert len(df) == 960 and df["source_row"].tolist() == list(range(1, 961))
    validate_cfg = ValidateConfig()
    train, test = split_by_conversation(df, validate_cfg.test_fraction, seed=0)
    result = validate_preferences(
        {"train": train, "test": test}, cfg=validate_cfg, tokenizer=tiny_tokenizer(), report_dir=tmp_path / "r"
    )
    assert result.success
    assert result.summary()["validate/test_rows"] > 60  # about a tenth of 960 pairs


def test_command_line(tmp_path, capsys):
    main(["--out", str(tmp_path), "--n-prompts", "20", "--pairs-per-prompt", "1", "--seed", "5"])
    assert "wrote 20 pairs" in capsys.readouterr().out
    assert (tmp_path / "preferences.jsonl").read_text().count("\n") == 20
