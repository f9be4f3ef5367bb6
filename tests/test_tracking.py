"""MLflow logging on a real sqlite store: a dataset is logged without warnings."""

from __future__ import annotations

import json
import warnings

import pytest

from rlhflow import tracking
from rlhflow.config import load_config
from rlhflow.hashing import file_md5


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    """The project's config tracking to a sqlite store in tmp_path; mlflow.set_tracking_uri exports
    $MLFLOW_TRACKING_URI, which monkeypatch puts back afterwards."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg = load_config(overrides=[f"tracking.tracking_uri={uri}"])
    tracking.setup(cfg)
    return cfg


def test_log_dataset_emits_no_warnings(cfg, tmp_path):
    import mlflow

    path = tmp_path / "train.jsonl"
    # as validate writes a split: string columns, a list column (left out of the logged schema), an integer one
    rows = [
        {
            "prompt": f"q{i}",
            "prompt_messages": [{"role": "user", "content": f"q{i}"}],
            "chosen": "a",
            "rejected": "b",
            "source_row": i,
        }
        for i in range(3)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with mlflow.start_run() as run:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            digest = tracking.log_dataset(path, name="preferences-train", context="training")
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []

    (logged,) = mlflow.MlflowClient().get_run(run.info.run_id).inputs.dataset_inputs
    assert digest == file_md5(path)
    assert (logged.dataset.name, logged.dataset.digest) == ("preferences-train", digest)
    assert logged.dataset.source_type == "local"
    assert json.loads(logged.dataset.source) == {"uri": str(path)}
    columns = {c["name"]: c["type"] for c in json.loads(logged.dataset.schema)["mlflow_colspec"]}
    assert columns == {"prompt": "string", "chosen": "string", "rejected": "string", "source_row": "double"}
