"""Light doors: how long each command takes to answer `--help`, here and in another checkout side by side.

    python -m bench.doors                        # this checkout: median wall seconds of `python -m X --help`
    python -m bench.doors --against ../old       # and another checkout of the project (e.g. a `git worktree` of an
                                                 # older commit), the two run in turn, with the ratio pair by pair

tests/test_doors.py pins what each of these loads (none of HEAVY); the times live here, not in the tests.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# the stack: what a command's door must not load before it knows what to do
HEAVY = frozenset(
    {
        "torch",
        "transformers",
        "mlflow",
        "prefect",
        "dvc",
        "great_expectations",
        "peft",
        "trl",
        "pandas",
        "datasets",
        "accelerate",
        "sklearn",
        "scipy",
    }
)

STAGE_DOORS = (
    "tasks.demo_data",
    "tasks.validate",
    "tasks.sft",
    "tasks.reward_model",
    "tasks.judge",
    "tasks.sft_answers",
    "tasks.ppo",
    "tasks.evaluate",
    "tasks.feedback",
)
FLOW_DOORS = (
    "flows.pipeline",
    "flows.compare",
    "flows.feedback",
    "flows.restore",
    "flows.serve",
    "flows.sweep",
    "flows.team",
)
OPS_DOORS = ("rlhfops.launch", "rlhfops.labeling", "rlhfops.stack", "rlhfops.dvc_yaml", "rlhflow.data.demo")
BENCH_DOORS = (
    "bench.doors",
    "bench.align_compare",
    "bench.answer_lengths",
    "bench.arm_frontier",
    "bench.decode_roofline",
    "bench.eval_batching",
    "bench.gpu_ppo",
    "bench.headline",
    "bench.logprob_error",
    "bench.orchestration",
    "bench.ppo_bench",
    "bench.ppo_precision",
    "bench.ppo_settings",
    "bench.precision_frontier",
    "bench.precision_stages",
    "bench.profile_compare",
    "bench.profile_run",
    "bench.reward_model_recipes",
)
ENTRY_POINTS = STAGE_DOORS + FLOW_DOORS + OPS_DOORS + BENCH_DOORS


def help_seconds(repo: Path, module: str) -> float:
    """Wall seconds of `python -m module --help` in `repo` (this interpreter, the repo first on the path)."""
    env = {**os.environ, "PYTHONPATH": str(repo)}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", module, "--help"], cwd=repo, env=env, capture_output=True, timeout=300)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Time each command's --help, against another checkout if given.")
    parser.add_argument("--against", type=Path, default=None, help="another checkout of the project, run in turn")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each command (the median is printed)")
    parser.add_argument("--only", nargs="*", default=None, help="these entry points (default: all)")
    args = parser.parse_args(argv)
    here = Path(__file__).resolve().parents[1]
    modules = args.only or ENTRY_POINTS
    print("| command `--help` | this checkout (s) |" + (" other (s) | this / other |" if args.against else ""))
    print("|---|---:|" + ("---:|---:|" if args.against else ""))
    for module in modules:
        mine, other = [], []
        for _ in range(args.rounds):
            mine.append(help_seconds(here, module))
            if args.against:
                other.append(help_seconds(args.against.resolve(), module))
        row = f"| `{module}` | {statistics.median(mine):.2f} |"
        if args.against:
            ratio = statistics.median(m / o for m, o in zip(mine, other))
            row += f" {statistics.median(other):.2f} | {ratio:.2f}x |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
