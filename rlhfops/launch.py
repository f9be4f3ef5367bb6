"""Start a stage in as many processes as params.yaml's `launch` section gives it: dvc.yaml's command for the
data-parallel stages (reward_model, judge, ppo), and what the flow runs for such a stage set to more than one.

    python -m rlhfops.launch ppo [--params FILE] [--set key=value ...]

One process: the stage's CLI, in this process. N processes: `accelerate launch --config_file
<launch.accelerate_config> --num_processes N -m tasks.<stage>` with the same arguments; each process trains its share
of each global batch, rank 0 alone logs, writes and records. Inside a flow run the processes get the run's config as
a params file, the parent MLflow run's id and `FLOW_ENV` (the flow holds the workspace and records). docs/scaling.md.
"""

from __future__ import annotations

# A light door: torch is imported inside the function that asks it for a GPU, so --help answers before it loads.
import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections import deque
from pathlib import Path

from rlhflow.config.params import REPO_ROOT, Config, parse_config_args, write_params
from rlhfops.stage_runner import cli
from rlhfops.stages import FLOW_ENV, get_stage, parent_run_option


def processes(stage: str, cfg: Config) -> int:
    """How many processes run `stage`: `launch.<stage>` for a data-parallel stage, else 1."""
    return getattr(cfg.launch, stage) if get_stage(stage).data_parallel else 1


def accelerate_config(cfg: Config) -> Path:
    """launch.accelerate_config, else the project's own: DDP where there is a GPU, two CPU processes where not."""
    if cfg.launch.accelerate_config:
        return cfg.path(cfg.launch.accelerate_config)
    import torch

    return REPO_ROOT / "configs" / "accelerate" / ("ddp.yaml" if torch.cuda.is_available() else "cpu_2proc.yaml")


def _free_port() -> int:
    """The processes' rendezvous port: a free one, so that two launches at once do not collide on 29500."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def command(stage: str, cfg: Config, args: list[str]) -> list[str]:
    """The command line that runs `stage` in `processes(stage, cfg)` processes with the CLI arguments `args`."""
    n = processes(stage, cfg)
    module = get_stage(stage).module
    if n == 1:
        return [sys.executable, "-m", module, *args]
    config = accelerate_config(cfg)
    if not config.is_file():
        raise FileNotFoundError(f"launch.accelerate_config: {config} does not exist")
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    return [*launcher, "--num_processes", str(n), "--main_process_port", str(_free_port()), "-m", module, *args]


def run_in_processes(stage: str, cfg: Config, parent_run_id: str | None) -> dict[str, float]:
    """For the flow: run the stage in its processes with this run's config, under the parent MLflow run; the
    processes' output goes to this process's stdout (the flow run's log). Returns the stage's metrics (its metrics
    file, written by rank 0). A failure raises naming the stage, the process count and the last lines."""
    n = processes(stage, cfg)
    with tempfile.TemporaryDirectory(prefix=f"rlhf-{stage}-") as tmp:
        params = Path(tmp) / "params.yaml"
        write_params(cfg, params)
        args = ["--params", str(params)] + (["--parent-run-id", parent_run_id] if parent_run_id else [])
        env = {**os.environ, FLOW_ENV: "1"}
        tail: deque[str] = deque(maxlen=30)
        with subprocess.Popen(
            command(stage, cfg, args),
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ) as proc:
            for line in proc.stdout:
                tail.append(line.rstrip())
                print(line, end="")
        if proc.returncode != 0:
            last = "\n".join(tail)
            raise RuntimeError(f"stage {stage} failed in {n} processes (exit status {proc.returncode}):\n{last}")
    path = cfg.path(cfg.metrics_dir) / f"{stage}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):  # `STAGE --help` lists the stage's options and the params keys
        print(__doc__.strip())
        return
    if not argv or argv[0].startswith("-"):
        sys.exit("usage: python -m rlhfops.launch STAGE [--params FILE] [--set key=value ...]")
    stage, args = argv[0], argv[1:]
    cfg, _ = parse_config_args(args, f"Run the {stage} stage in launch.{stage} processes.", (parent_run_option(),))
    n = processes(stage, cfg)
    if n == 1:
        cli(stage, importlib.import_module(get_stage(stage).module).run, args)
        return
    cmd = command(stage, cfg, args)
    print(f"{stage}: {n} processes: {' '.join(cmd[1:5])} ...", flush=True)
    os.execv(cmd[0], cmd)  # the launcher replaces this process: DVC and the flow see its exit status and signals


if __name__ == "__main__":
    main()
