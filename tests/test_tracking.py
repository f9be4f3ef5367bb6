"""MLflow tracking on a real sqlite store: a relative sqlite path, as users write it, names a store under the
project root; a dataset is logged without warnings; the logged policy and reward models carry a signature and an
input example, and load and predict from the registry (tiny models)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from rlhflow.config.params import load_config
from rlhfops import registry, tracking
from rlhfops.hashing import file_md5


@pytest.fixture
def repo_root(tmp_path, monkeypatch):
    """A stand-in repository root; the tests run from another directory, so nothing may resolve against the cwd."""
    import mlflow

    root, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    monkeypatch.setattr(tracking, "project_root", lambda: root)
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # mlflow.set_tracking_uri exports it
    before = mlflow.get_tracking_uri()
    yield root
    mlflow.set_tracking_uri(before)


def test_a_dvc_experiment_copy_belongs_to_the_repository_around_it(tmp_path):
    from rlhflow.config.params import project_root

    assert project_root(tmp_path / "proj" / ".dvc" / "tmp" / "exps" / "tmpa1b2c3") == tmp_path / "proj"
    assert project_root(tmp_path / "proj") == tmp_path / "proj"


def test_relative_sqlite_uris_resolve_against_the_repository_root(repo_root):
    assert tracking.absolute_sqlite_uri("sqlite:///./mlflow.db") == f"sqlite:///{repo_root}/mlflow.db"
    assert tracking.absolute_sqlite_uri("sqlite:///runs/../mlflow.db") == f"sqlite:///{repo_root}/mlflow.db"
    assert tracking.absolute_sqlite_uri("sqlite:///runs/m.db?timeout=5") == f"sqlite:///{repo_root}/runs/m.db?timeout=5"
    for unchanged in ("sqlite:////abs/mlflow.db", "sqlite:///:memory:", "http://host:5000", "databricks"):
        assert tracking.absolute_sqlite_uri(unchanged) == unchanged
    assert tracking.tracking_uri(load_config()) == f"sqlite:///{repo_root}/mlflow.db"  # the default, the same way


def test_a_relative_sqlite_store_records_runs_and_artifacts_under_the_repository_root(repo_root):
    """`--set tracking.tracking_uri=sqlite:///./mlflow.db`: the preflight, the experiment's artifact root (a file URI,
    which a relative path cannot be) and the runs all use <repo>/mlflow.db and <repo>/mlartifacts."""
    cfg = load_config(overrides=["tracking.tracking_uri=sqlite:///./mlflow.db"])
    assert tracking.sqlite_artifact_root(cfg.tracking.tracking_uri) == repo_root / "mlartifacts"
    tracking.preflight(cfg)
    mlflow = tracking.setup(cfg)
    with mlflow.start_run() as run:
        mlflow.log_metric("m", 1.0)
        mlflow.log_text("hello", "note.txt")
    assert (repo_root / "mlflow.db").is_file()
    client = mlflow.MlflowClient(f"sqlite:///{repo_root}/mlflow.db")
    assert client.get_run(run.info.run_id).data.metrics == {"m": 1.0}
    (note,) = (repo_root / "mlartifacts").rglob("note.txt")
    assert note.read_text() == "hello"
    assert not list((repo_root.parent / "elsewhere").iterdir())  # nothing relative to the cwd


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    """The project's config tracking to a sqlite store in tmp_path; mlflow.set_tracking_uri exports
    $MLFLOW_TRACKING_URI, which monkeypatch puts back afterwards."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg = load_config(overrides=[f"tracking.tracking_uri={uri}"])
    tracking.setup(cfg)
    return cfg


def test_runs_starting_together_each_find_the_experiment_the_first_one_tagged(repo_root, monkeypatch):
    """Two runs set up the experiment at once: the other run writes a tag between this run's read and its write,
    and a store on PostgreSQL answers this run's insert with a unique-key error. Setup reads the experiment again
    and goes on; an error that is no such race (the experiment cannot be made) still stops it."""
    import mlflow
    from mlflow.exceptions import MlflowException

    cfg = load_config(overrides=["tracking.tracking_uri=sqlite:///./mlflow.db"])
    real_set = mlflow.set_experiment_tag
    calls = []

    def set_after_another_run(key, value):
        calls.append(key)
        if len(calls) == 1:  # the other run got there first
            client = mlflow.MlflowClient(tracking.tracking_uri(cfg))
            experiment = client.get_experiment_by_name(cfg.tracking.experiment)
            for other_key, other_value in tracking.EXPERIMENT_TAGS.items():
                client.set_experiment_tag(experiment.experiment_id, other_key, other_value)
            raise MlflowException(f'duplicate key value violates unique constraint "experiment_tag_pk": {key}')
        real_set(key, value)

    monkeypatch.setattr(mlflow, "set_experiment_tag", set_after_another_run)
    tracking.setup(cfg)
    assert calls == [next(iter(tracking.EXPERIMENT_TAGS))]  # read again: nothing left to write
    experiment = mlflow.get_experiment_by_name(cfg.tracking.experiment)
    assert {k: experiment.tags[k] for k in tracking.EXPERIMENT_TAGS} == tracking.EXPERIMENT_TAGS

    def refuse(name, **kwargs):
        raise MlflowException(f"cannot create experiment {name}")

    monkeypatch.setattr(mlflow, "create_experiment", refuse)
    other = load_config(overrides=["tracking.tracking_uri=sqlite:///./mlflow.db", "tracking.experiment=fresh"])
    with pytest.raises(MlflowException, match="cannot create experiment fresh"):
        tracking.setup(other)


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


def _tiny_reward_model_dir(model_dir: Path, out: Path) -> Path:
    from rlhflow.training.reward_model import load_backbone, write_normalization

    model, tok = load_backbone(str(model_dir))
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    write_normalization(out, mean=0.0, std=1.0, max_length=64)
    return out


def test_logged_models_carry_signatures(cfg, tmp_path, tiny_model_dir):
    import mlflow
    import pandas as pd

    from rlhfops.serving.policy import PolicyPyfunc
    from rlhfops.serving.reward import RewardPyfunc

    reward_dir = _tiny_reward_model_dir(tiny_model_dir, tmp_path / "reward_model")
    with mlflow.start_run():
        registry.log_model_dir(cfg, tiny_model_dir, name="policy", wrapper=PolicyPyfunc, registered_name="rlhf-policy")
        registry.log_model_dir(
            cfg, reward_dir, name="reward_model", wrapper=RewardPyfunc, registered_name="rlhf-reward"
        )

    policy = mlflow.pyfunc.load_model("models:/rlhf-policy@candidate")
    assert _columns(policy.metadata.get_input_schema()) == [("prompt", "string")]
    assert _columns(policy.metadata.get_output_schema()) == [("response", "string")]
    assert {p.name for p in policy.metadata.get_params_schema().params} >= {"max_new_tokens", "temperature"}
    assert list(policy.input_example.columns) == ["prompt"]
    responses = policy.predict(pd.DataFrame({"prompt": ["Hello?", "Thanks!"]}), params={"max_new_tokens": 2})
    assert len(responses) == 2 and all(isinstance(r, str) for r in responses)

    reward = mlflow.pyfunc.load_model("models:/rlhf-reward@candidate")
    assert _columns(reward.metadata.get_input_schema()) == [("prompt", "string"), ("response", "string")]
    assert _columns(reward.metadata.get_output_schema()) == [("score", "double")]
    scores = reward.predict(reward.input_example)
    assert len(scores) == 1 and isinstance(scores[0], float)


def _columns(schema) -> list[tuple[str, str]]:
    return [(c["name"], c["type"]) for c in schema.to_dict()]


def test_commits_that_change_only_docs_tests_or_benches_hold_the_same_code(tmp_path):
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True).stdout.strip()

    def commit(path: str, text: str) -> str:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
        git("add", path)
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", path)
        return git("rev-parse", "HEAD")

    git("init", "-q")
    start = commit("tasks/ppo.py", "a = 1\n")
    docs = commit("docs/benchmarks.md", "figures\n")
    for path in ("README.md", "tests/test_x.py", "bench/x.py", ".ci/run"):
        docs = commit(path, "x\n")
    assert tracking.same_code(start, docs, root=tmp_path)
    params = commit("params.yaml", "seed: 0\n")
    assert not tracking.same_code(start, params, root=tmp_path)
    assert tracking.same_code(params, "HEAD", root=tmp_path)
    code = commit("tasks/ppo.py", "a = 2\n")
    assert not tracking.same_code(params, code, root=tmp_path)
    assert not tracking.same_code("0" * 40, code, root=tmp_path)  # a commit this repository does not have


def test_an_option_added_at_its_neutral_value_leaves_the_params_digest_as_it_was():
    """tracking.DIGEST_NEUTRAL: at its neutral value an added option is left out of the digest, so runs recorded
    before it existed keep theirs; any other value is a different configuration."""
    import hashlib
    import json

    from rlhflow.config.params import load_config

    cfg = load_config()
    before = cfg.to_params()
    for key in tracking.DIGEST_NEUTRAL:
        *path, name = key.split(".")
        section = before
        for part in path:
            section = section[part]
        del section[name]  # the params as they were written before the option existed
    assert (
        tracking.params_digest(cfg) == hashlib.md5(json.dumps(before, sort_keys=True, default=str).encode()).hexdigest()
    )
    assert tracking.params_digest(load_config(overrides=["ppo.fp32_lm_head=true"])) != tracking.params_digest(cfg)
