"""Shared fixtures: tiny real models and a tiny-pipeline parameter set, all built locally."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run faster on one thread, and far faster when other work shares the 2 cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tok():
    """The tiny tokenizer (byte-level BPE with a ChatML template)."""
    from rlhflow.testing import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from rlhflow.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def tiny_pipeline_overrides(root: Path | str, model_dir: Path, *, tracking: bool = True) -> list[str]:
    """`--set` values that run the whole pipeline in seconds on tiny models, writing only under `root`
    (a relative root such as "." keeps paths relative to the repo, as DVC outputs must be)."""
    overrides = [
        f"data.preferences={root}/data/raw/demo/preferences.jsonl",
        f"data.demo.out_dir={root}/data/raw/demo",
        "data.demo.n_prompts=60",
        f"validate.out_dir={root}/data/validated",
        f"validate.report_dir={root}/reports/validation",
        f"sft.model={model_dir}",
        f"sft.out_dir={root}/models/sft",
        "sft.n_samples=2",
        "sft.max_new_tokens=8",
        "sft.perplexity_rows=8",
        "reward_model.backbone=sft",
        f"reward_model.out_dir={root}/models/reward_model",
        "reward_model.epochs=1",
        "reward_model.batch_size=8",
        "reward_model.hh_eval_rows=16",
        f"ppo.out_dir={root}/models/policy",
        f"ppo.checkpoint_dir={root}/checkpoints/ppo",
        "ppo.steps=2",
        "ppo.batch_size=4",
        "ppo.mini_batch_size=2",
        "ppo.max_new_tokens=8",
        "ppo.checkpoint_every=1",
        "evaluate.n_prompts=4",
        "evaluate.max_new_tokens=8",
        "evaluate.perplexity_rows=4",
        f"evaluate.report_dir={root}/reports/evaluate",
        f"metrics_dir={root}/metrics",
    ]
    if tracking:
        overrides.append(f"tracking.tracking_uri=sqlite:///{root}/mlflow.db")
    return overrides
