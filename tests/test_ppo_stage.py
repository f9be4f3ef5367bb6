"""The ppo stage as users run it (`python -m tasks.ppo`): killed and restarted it resumes and ends where an
uninterrupted run ends; a non-finite reward stops it, keeps the last good checkpoint and fails the MLflow run."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from conftest import REPO, kill_stage_once, stage_command, stage_env

STEPS, CHECKPOINT_EVERY = 24, 4


def ppo_overrides(root: Path, model_dir: Path, **extra) -> list[str]:
    values = {
        "sft.out_dir": model_dir,
        "validate.out_dir": root / "validated",
        "reward_model.out_dir": root / "no_reward_model",
        "ppo.reward_fn": "rlhflow.ppo.reward_functions:vowel_fraction",
        "ppo.steps": STEPS,
        "ppo.batch_size": 8,
        "ppo.mini_batch_size": 4,
        "ppo.ppo_epochs": 2,
        "ppo.learning_rate": 1e-2,
        "ppo.max_new_tokens": 8,
        "ppo.temperature": 1.0,
        "ppo.checkpoint_every": CHECKPOINT_EVERY,
        "ppo.out_dir": root / "policy",
        "ppo.checkpoint_dir": root / "ckpt",
        "metrics_dir": root / "metrics",
        "tracking.tracking_uri": f"sqlite:///{root}/mlflow.db",
        "tracking.log_models": False,
        **extra,
    }
    return [f"{key}={value}" for key, value in values.items()]


@pytest.fixture()
def stage_inputs(tmp_path, tiny_model_dir):
    """A validated training split (the prompts PPO samples from) next to the tiny SFT model."""
    from rlhflow.data.readers import write_jsonl

    prompts = ["hello world", "explain water", "thanks", "say yes", "fox dog", "steps one two", "help me", "boils"]
    rows = [
        {
            "prompt": p,
            "prompt_messages": [{"role": "user", "content": p}],
            "chosen": "yes",
            "rejected": "no",
            "source_row": i,
        }
        for i, p in enumerate(prompts)
    ]
    write_jsonl(pd.DataFrame(rows), tmp_path / "validated" / "train.jsonl")
    return tmp_path


def ppo_command(overrides: list[str]) -> list[str]:
    return stage_command("tasks.ppo", overrides)


@pytest.mark.system
def test_killed_ppo_stage_resumes_and_ends_like_an_uninterrupted_run(tmp_path, stage_inputs, tiny_model_dir):
    full_root, killed_root = tmp_path / "full", tmp_path / "killed"
    for root in (full_root, killed_root):
        (root / "validated").mkdir(parents=True)
        (root / "validated" / "train.jsonl").write_bytes((stage_inputs / "validated" / "train.jsonl").read_bytes())

    subprocess.run(
        ppo_command(ppo_overrides(full_root, tiny_model_dir)),
        cwd=REPO,
        env=stage_env(),
        check=True,
        capture_output=True,
        text=True,
    )
    uninterrupted = pd.read_csv(full_root / "metrics" / "ppo_history.csv")

    # SIGKILL (no clean-up can run) once the second checkpoint is on disk
    kill_stage_once(
        ppo_command(ppo_overrides(killed_root, tiny_model_dir)),
        killed_root / "ckpt" / f"step-{2 * CHECKPOINT_EVERY:06d}",
        timeout=120,
    )
    assert not (killed_root / "policy").exists()  # no final model from a killed run
    killed_at = max(int(p.name.split("-")[1]) for p in (killed_root / "ckpt").glob("step-*"))
    assert CHECKPOINT_EVERY * 2 <= killed_at < STEPS

    rerun = subprocess.run(
        ppo_command(ppo_overrides(killed_root, tiny_model_dir)),
        cwd=REPO,
        env=stage_env(),
        check=True,
        capture_output=True,
        text=True,
    )
    assert f"resuming from the checkpoint of update {killed_at}" in rerun.stdout
    resumed = pd.read_csv(killed_root / "metrics" / "ppo_history.csv")
    assert not (killed_root / "ckpt").exists()  # finished: nothing left to resume

    # same updates, same statistics (timings aside): float32 on one thread, tolerance 1e-4 relative
    assert list(resumed["step"]) == list(range(1, STEPS + 1))
    columns = [c for c in uninterrupted.columns if not c.startswith("time/")]
    pd.testing.assert_frame_equal(resumed[columns], uninterrupted[columns], rtol=1e-4, atol=1e-6)
    # it learns: the second half's mean score above the first half's (halves of 12 batches: a batch of 8 tiny-model
    # answers scores within about +-0.08 of its trend, and 4 batches a side were a coin flip on some CPUs)
    half = STEPS // 2
    assert uninterrupted["ppo/score_mean"].iloc[half:].mean() > uninterrupted["ppo/score_mean"].iloc[:half].mean()

    # the resumed run's MLflow curves are complete and say where it resumed
    client = mlflow.MlflowClient(f"sqlite:///{killed_root}/mlflow.db")
    finished = [
        r
        for r in client.search_runs([client.get_experiment_by_name("rlhf").experiment_id])
        if r.info.status == "FINISHED"
    ]
    assert len(finished) == 1
    assert finished[0].data.metrics["ppo/resumed_from_update"] == killed_at
    assert len(client.get_metric_history(finished[0].info.run_id, "ppo/score_mean")) == STEPS


def test_non_finite_reward_fails_the_stage_and_keeps_the_last_good_checkpoint(
    tmp_path, stage_inputs, tiny_model_dir, monkeypatch, allow_test_reward
):
    module = tmp_path / "nan_after_three.py"
    module.write_text(
        textwrap.dedent("""
        calls = []

        def reward(prompts, responses):
            calls.append(1)
            return [float("nan") if len(calls) == 4 else 0.5] * len(responses)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from rlhflow.config.params import load_config
    from rlhflow.ppo.trainer import NonFiniteError
    from rlhfops.stage_runner import run_stage
    from tasks import ppo

    cfg = load_config(
        None,
        ppo_overrides(
            tmp_path,
            tiny_model_dir,
            **{"ppo.reward_fn": "nan_after_three:reward", "ppo.checkpoint_every": 2, "ppo.steps": 6},
        ),
    )
    with pytest.raises(NonFiniteError, match="score in PPO update 4"):
        run_stage("ppo", ppo.run, cfg)

    assert [p.name for p in (tmp_path / "ckpt").glob("step-*")] == ["step-000002"]
    assert not (tmp_path / "policy").exists()
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("rlhf").experiment_id])
    assert run.info.status == "FAILED"
    assert "score in PPO update 4" in run.data.tags["error"]
