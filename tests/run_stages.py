"""Run several stages one after the other in one process, each exactly as its CLI (`python -m tasks.<stage>
--set ...`) would: what tests/test_distributed.py starts with `accelerate launch`, so that the processes'
start-up (imports, process group) is paid once for both data-parallel stages.

    python -m tests.run_stages reward_model,ppo --set key=value ...
"""

import importlib
import sys

from rlhfops.stage_runner import cli

if __name__ == "__main__":
    stages, args = sys.argv[1].split(","), sys.argv[2:]
    for stage in stages:
        cli(stage, importlib.import_module(f"tasks.{stage}").run, args)
