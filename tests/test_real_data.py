"""The shipped real preference data as the default input.

- With the default model's tokenizer it passes `validate` on params.yaml as it is: the few over-long and blank
  rows are dropped and counted per reason, and the judge's split is disjoint from the proxy's, checked on the files.
- The whole flow on it (tiny models) logs every judge and interval metric on the stage runs and the parent run."""

from __future__ import annotations

import json

import pytest
from conftest import run_stage_cli, tiny_pipeline_overrides

from rlhflow.config.params import DEFAULT_PREFERENCES
from rlhflow.data.readers import read_jsonl
from rlhflow.data.splits import conversation_keys
from rlhfops.hashing import file_md5

JUDGE_METRICS = [
    "eval/judge_win_rate_vs_sft",
    "eval/judge_reward_mean",
    "eval/judge_reward_mean_sft",
    "eval/win_rate_ci_low",
    "eval/win_rate_ci_high",
    "eval/judge_win_rate_ci_low",
    "eval/judge_win_rate_ci_high",
    "eval/proxy_judge_gap",
    # length-aware: the length-controlled win rates, the gap's interval, the length rule beside each reward model
    "eval/win_rate_lc",
    "eval/win_rate_lc_ci_low",
    "eval/judge_win_rate_lc",
    "eval/judge_win_rate_lc_ci_high",
    "eval/proxy_judge_gap_ci_low",
    "eval/proxy_judge_gap_ci_high",
    "rm/length_baseline_accuracy",
    "rm/accuracy_minus_length_baseline",
    "rm/accuracy_minus_length_baseline_ci_low",
]


@pytest.mark.system
def test_shipped_data_passes_validate_with_the_default_tokenizer(tmp_path):
    overrides = [
        f"validate.out_dir={tmp_path}/validated",
        f"validate.report_dir={tmp_path}/report",
        f"metrics_dir={tmp_path}/metrics",
        f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
    ]
    done = run_stage_cli("tasks.validate", overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics/validate.json").read_text())
    # 23 of the 1,500 pairs: 18 prompts and 1 rejected response over 512 tokens, 4 empty chosen responses
    assert metrics["validate/dropped_overlong_prompt"] == 18 and metrics["validate/dropped_overlong_rejected"] == 1
    assert metrics["validate/dropped_blank_chosen"] == 4
    assert metrics["validate/dropped_rows"] == 23 and metrics["validate/dropped_fraction"] <= 0.05
    assert "validate: dropped 18 row(s): overlong_prompt" in done.stdout

    splits = {name: read_jsonl(tmp_path / "validated" / f"{name}.jsonl") for name in ("train", "judge", "dev", "test")}
    assert sum(len(df) for df in splits.values()) == 1500 - 23
    assert all(metrics[f"validate/{name}_rows"] == len(df) for name, df in splits.items())
    conversations = {name: set(conversation_keys(df)) for name, df in splits.items()}
    assert not conversations["train"] & conversations["judge"], "the judge trains on the proxy's conversations"
    for a, b in [("judge", "test"), ("train", "test"), ("train", "dev"), ("judge", "dev"), ("dev", "test")]:
        assert not conversations[a] & conversations[b], (a, b)
    # the shipped file's held-out conversations: 153 to choose on, 128 to report
    assert (len(conversations["dev"]), len(conversations["test"])) == (153, 128)
    assert metrics["validate/cross_split_prefix_pairs"] == 0
    assert all(metrics[f"validate/{name}_conversations"] == len(c) for name, c in conversations.items())
    pairs = {name: set(zip(df["chosen"], df["rejected"])) for name, df in splits.items()}
    assert not pairs["train"] & pairs["judge"]
    assert len(splits["judge"]) > 300 and len(splits["train"]) > 2 * len(splits["judge"])
    report = json.loads((tmp_path / "report/validation.json").read_text())
    assert report["success"] and report["dropped"]["rows"] == 23

    # the training seed does not move the split: every split file keeps its md5
    again = [o.replace(str(tmp_path), str(tmp_path / "seed7")) for o in overrides] + ["seed=7"]
    done = run_stage_cli("tasks.validate", again)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("train", "judge", "dev", "test"):
        assert file_md5(tmp_path / "seed7/validated" / f"{name}.jsonl") == file_md5(
            tmp_path / "validated" / f"{name}.jsonl"
        ), name


@pytest.mark.system
@pytest.mark.slow
def test_flow_on_the_shipped_data_logs_the_judge_and_the_intervals(prefect_server, tmp_path, tiny_model_dir):
    import mlflow

    from flows.pipeline import rlhf_pipeline

    overrides = [o for o in tiny_pipeline_overrides(tmp_path, tiny_model_dir) if not o.startswith("data.preferences=")]
    # the tiny tokenizer spends many more tokens per word than the default model's
    overrides += [
        "validate.max_prompt_tokens=100000",
        "validate.max_response_tokens=100000",
        "reward_model.max_length=128",
        "judge.max_length=128",
        "evaluate.n_prompts=8",
    ]
    results = rlhf_pipeline(overrides=overrides)
    assert (tmp_path / "data/validated/judge.jsonl").exists()

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("rlhf").experiment_id])
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    children = {r.data.tags["stage"]: r for r in runs if "stage" in r.data.tags}
    assert parent.data.params["data.preferences"] == DEFAULT_PREFERENCES
    for key in JUDGE_METRICS:
        assert children["evaluate"].data.metrics[key] == pytest.approx(results[key]), key
        assert parent.data.metrics[key] == pytest.approx(results[key]), key
    for key in ("judge/accuracy", "judge/accuracy_se", "judge/length_baseline_accuracy", "judge/accuracy_ci_low"):
        assert key in children["judge"].data.metrics and key in parent.data.metrics
    assert 0 <= parent.data.metrics["judge/accuracy"] <= 1 and "rm/accuracy_se" in children["reward_model"].data.metrics
    assert results["eval/win_rate_ci_low"] <= results["eval/win_rate_vs_sft"] <= results["eval/win_rate_ci_high"]
    assert (
        results["eval/judge_win_rate_ci_low"]
        <= results["eval/judge_win_rate_vs_sft"]
        <= results["eval/judge_win_rate_ci_high"]
    )
    assert results["eval/proxy_judge_gap"] == pytest.approx(
        results["eval/win_rate_vs_sft"] - results["eval/judge_win_rate_vs_sft"]
    )
    assert "validate/dropped_fraction" in children["validate"].data.metrics
    assert {d.dataset.name for d in children["judge"].inputs.dataset_inputs} == {"preferences-judge"}

    # the judge is its own registered model; the report has the registry's decisions
    assert client.get_model_version_by_alias("rlhf-judge", "candidate").run_id == children["judge"].info.run_id
    report = (tmp_path / "reports/evaluate/report.md").read_text()
    assert "| rlhf-policy | v1 | v1 | promoted | no champion yet" in report  # the registry table
    assert "judge (never optimised against)" in report and "Judge accuracy on held-out pairs" in report
