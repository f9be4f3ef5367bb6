"""Data parallelism: the reward_model and ppo stages under `accelerate launch` with 2 CPU processes (gloo) on
tiny models, against in-process single-process runs of the same stage code with the same global batch.

Batch sizes are global, so 1 or N processes must train alike: the reward model ends with the same weights (DDP over
batch_size / 2 pairs per process); PPO with top_k=1 (rollouts independent of how prompts are split) logs the same
global statistics and ends with the same weights. Local whitening, unscaled or missing gradient all-reduces, or
per-process batches of the full batch_size each make them differ. Only rank 0 writes: one MLflow run per stage, one
metrics file, no stray output dirs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import ALLOW_TEST_REWARD, REPO
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # two `accelerate launch` processes start up: about a minute on 2 cores

CPU_2PROC = REPO / "configs" / "accelerate" / "cpu_2proc.yaml"
PROMPTS = ["hello world", "explain water", "thanks", "say yes", "fox dog", "steps one two", "help me", "boils"]
# The statistics that are means over the global batch (time/* is the main process's own; lr is a setting).
PPO_GLOBAL_STATS = [
    "ppo/score_mean",
    "ppo/score_std",
    "ppo/reward_total_mean",
    "ppo/kl",
    "ppo/entropy",
    "ppo/returns_mean",
    "ppo/advantages_mean",
    "ppo/response_length",
    "ppo/eos_fraction",
    "ppo/policy_loss",
    "ppo/value_loss",
    "ppo/clipfrac",
    "ppo/approxkl",
    "ppo/responses",
]


def write_validated_splits(out_dir: Path) -> None:
    """16 train pairs (8 prompts x 2) and 4 test pairs, in the validate stage's output format."""
    out_dir.mkdir(parents=True, exist_ok=True)

    def row(prompt: str, i: int) -> dict:
        return {
            "prompt": prompt,
            "prompt_messages": [{"role": "user", "content": prompt}],
            "chosen": f"Thank you! Here are {i + 2} clear steps about {prompt}.",
            "rejected": "no" * (i % 3 + 1),
        }

    train = [row(p, i) for i, p in enumerate(PROMPTS * 2)]
    test = [row(f"{p} please", i) for i, p in enumerate(PROMPTS[:4])]
    for name, rows in (("train", train), ("test", test)):
        (out_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def overrides(root: Path, model_dir: Path, run: str) -> list[str]:
    """Both stages on tiny models; `run` names this run's own outputs, metrics and MLflow store."""
    return [
        f"validate.out_dir={root}/validated",
        f"sft.out_dir={model_dir}",
        f"metrics_dir={root}/{run}/metrics",
        f"tracking.tracking_uri=sqlite:///{root}/{run}/mlflow.db",
        "tracking.log_models=false",
        f"reward_model.backbone={model_dir}",
        f"reward_model.out_dir={root}/{run}/reward_model",
        "reward_model.epochs=2",
        "reward_model.batch_size=8",
        "reward_model.learning_rate=1e-3",
        "reward_model.max_length=64",
        "reward_model.checkpoint_every=2",
        f"reward_model.checkpoint_dir={root}/{run}/rm_checkpoints",
        "reward_model.precision=fp32",  # as ppo.precision below
        f"ppo.out_dir={root}/{run}/policy",
        f"ppo.checkpoint_dir={root}/{run}/checkpoints",
        "ppo.reward_fn=tests.fixtures:prompt_length_reward",
        "ppo.precision=fp32",  # 1 and 2 processes agree to float32 rounding; bf16 rounding would hide a real gap
        "ppo.top_k=1",
        "ppo.steps=2",
        "ppo.batch_size=4",
        "ppo.mini_batch_size=4",
        "ppo.ppo_epochs=2",
        "ppo.learning_rate=1e-3",
        "ppo.max_new_tokens=8",
        "ppo.reward_normalization=whiten",
        "ppo.kl_coef=0.05",
        "ppo.checkpoint_every=1",
    ]


def free_port() -> int:
    """A port for the processes' rendezvous, so that concurrent runs do not collide on accelerate's 29500."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_two_processes(stages: list[str], args: list[str], log: Path) -> float:
    """`accelerate launch` the stages' CLIs (one after the other, tests/run_stages.py) in 2 CPU processes;
    returns the wall time."""
    env = {**os.environ, **ALLOW_TEST_REWARD, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [
        str(Path(sys.executable).parent / "accelerate"),
        "launch",
        "--config_file",
        str(CPU_2PROC),
        "--main_process_port",
        str(free_port()),
        "-m",
        "tests.run_stages",
        ",".join(stages),
    ]
    cmd += [a for o in args for a in ("--set", o)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    log.write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"accelerate launch failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
    return time.perf_counter() - start


def run_single_process(stage: str, args: list[str]) -> dict[str, float]:
    import importlib

    from rlhflow.config.params import load_config
    from rlhfops.stage_runner import run_stage

    return run_stage(stage, importlib.import_module(f"tasks.{stage}").run, load_config(None, args))


def stage_runs(root: Path, run: str, stage: str):
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{root}/{run}/mlflow.db")
    experiment = client.get_experiment_by_name("rlhf")
    return client, client.search_runs([experiment.experiment_id], f"tags.stage = '{stage}'")


def assert_same_weights(dir_1: Path, dir_2: Path, file: str, rel_tol: float, start: Path | None = None) -> None:
    """Per tensor, |w1 - w2| <= rel_tol * |w1 - start| (Frobenius norms): the two runs moved the weights the same
    way, up to float noise (which Adam amplifies on near-zero gradients; a different batch differs by O(1)).
    Tensors missing from `start` (a new head) are compared with their own size."""
    one, two = load_file(str(dir_1 / file)), load_file(str(dir_2 / file))
    base = load_file(str(start / file)) if start else {}
    assert one.keys() == two.keys()
    for name in one:
        a, b = one[name].double(), two[name].double()
        moved = (a - base[name].double()).norm() if name in base else a.norm()
        assert (a - b).norm() <= rel_tol * moved, f"{file}:{name} differs between 1 and 2 processes"


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_model_dir) -> Path:
    """Both stages run once in 2 processes (outputs under root/two); each test then runs its stage in-process."""
    root = tmp_path_factory.mktemp("dist")
    write_validated_splits(root / "validated")
    wall = launch_two_processes(["reward_model", "ppo"], overrides(root, tiny_model_dir, "two"), root / "two.log")
    print(f"\nreward_model + ppo under accelerate launch, 2 processes: {wall:.1f} s wall")
    return root


@pytest.mark.system
def test_reward_model_two_processes_equal_one_process_with_the_same_global_batch(
    root, tiny_model_dir, one_thread, allow_test_reward
):
    single = run_single_process("reward_model", overrides(root, tiny_model_dir, "one"))

    _, runs_two = stage_runs(root, "two", "reward_model")
    _, runs_one = stage_runs(root, "one", "reward_model")
    assert len(runs_two) == 1 and runs_two[0].info.status == "FINISHED"  # rank 1 opened no run
    two, one = runs_two[0].data.metrics, runs_one[0].data.metrics
    assert (two["rm/processes"], one["rm/processes"]) == (2.0, 1.0)
    # the global batch the Trainer used: 2 processes x 4 pairs, as 1 process x 8 pairs; so the same steps
    assert two["rm/global_batch_size"] == one["rm/global_batch_size"] == 8.0
    assert two["rm/train_steps"] == one["rm/train_steps"] == 4.0  # 16 pairs / 8 x 2 epochs
    assert_same_weights(
        root / "one" / "reward_model", root / "two" / "reward_model", "model.safetensors", 2e-2, start=tiny_model_dir
    )
    metrics_two = json.loads((root / "two" / "metrics" / "reward_model.json").read_text())
    assert metrics_two["rm/accuracy"] == pytest.approx(single["rm/accuracy"])
    assert metrics_two["rm/score_mean"] == pytest.approx(single["rm/score_mean"], abs=1e-4)
    assert not list((root / "two").glob(".reward_model.tmp-*"))  # no scratch output of rank 1 left behind
    assert not (root / "two" / "rm_checkpoints").exists()  # Trainer checkpoints (DDP) removed once finished


@pytest.mark.system
def test_ppo_two_processes_equal_one_process_with_the_same_global_batch(
    root, tiny_model_dir, one_thread, allow_test_reward
):
    single = run_single_process("ppo", overrides(root, tiny_model_dir, "one"))

    history_two = pd.read_csv(root / "two" / "metrics" / "ppo_history.csv")
    history_one = pd.read_csv(root / "one" / "metrics" / "ppo_history.csv")
    assert len(history_two) == len(history_one) == 2
    assert list(history_two["ppo/responses"]) == [4.0, 4.0]  # 2 processes x 2 prompts: the global batch
    for key in PPO_GLOBAL_STATS:
        assert history_two[key].tolist() == pytest.approx(history_one[key].tolist(), rel=1e-4, abs=1e-5), key
    assert history_one["ppo/policy_loss"].abs().max() > 1e-4  # the updates are not trivially zero

    # the same update: policy and value head moved by the same amounts from the SFT weights
    assert_same_weights(
        root / "one" / "policy", root / "two" / "policy", "model.safetensors", 1e-3, start=tiny_model_dir
    )
    assert_same_weights(root / "one" / "policy", root / "two" / "policy", "value_head.safetensors", 1e-3)

    _, runs_two = stage_runs(root, "two", "ppo")
    assert len(runs_two) == 1 and runs_two[0].info.status == "FINISHED"
    client, _ = stage_runs(root, "two", "ppo")
    assert len(client.get_metric_history(runs_two[0].info.run_id, "ppo/kl")) == 2  # logged once per update
    assert single["ppo/updates"] == 2.0
    assert not (root / "two" / "checkpoints").exists()  # rank 0 wrote the checkpoints and removed them at the end


@pytest.mark.system
def test_ppo_killed_in_two_processes_resumes_to_the_uninterrupted_run(root, tiny_model_dir):
    """SIGKILL the whole 2-process launch inside update 2 (after update 1's checkpoint), launch again: rank 0 reads the
    checkpoint and sends weights, optimiser and every stream to rank 1, and the run ends where the uninterrupted
    2-process run of the `root` fixture ended."""
    import signal

    import psutil

    args = overrides(root, tiny_model_dir, "resumed")
    marker = root / "resumed" / "checkpoints" / "step-000001" / "trainer_state.json"
    # the reward hangs once update 1's checkpoint is complete (tests/fixtures.py): the kill lands inside update 2
    env = {**os.environ, **ALLOW_TEST_REWARD, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["RLHF_TEST_HANG_WHEN"] = str(marker)
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_2PROC)]
    cmd += ["--main_process_port", str(free_port()), "-m", "tasks.ppo", *[a for o in args for a in ("--set", o)]]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(1.0)  # both processes are now inside update 2's reward
    # the launcher and both of its processes (torchrun starts them in sessions of their own: killpg would miss them)
    tree = psutil.Process(proc.pid)
    for process in [*tree.children(recursive=True), tree]:
        process.kill()
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"

    launch_two_processes(["ppo"], args, root / "resumed.log")
    assert "ppo: resuming from the checkpoint of update 1" in (root / "resumed.log").read_text()
    resumed = pd.read_csv(root / "resumed" / "metrics" / "ppo_history.csv")
    uninterrupted = pd.read_csv(root / "two" / "metrics" / "ppo_history.csv")
    for key in PPO_GLOBAL_STATS:
        assert resumed[key].tolist() == pytest.approx(uninterrupted[key].tolist(), rel=1e-4, abs=1e-5), key
    assert_same_weights(
        root / "two" / "policy", root / "resumed" / "policy", "model.safetensors", 1e-3, start=tiny_model_dir
    )
