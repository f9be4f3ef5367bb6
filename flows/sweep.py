"""Sweeps: a grid of pipeline runs, and the reward-KL frontier they draw against best-of-n sampling.

    python -m flows.sweep --grid ppo.kl_coef=0.02,0.05,0.1,0.2 [--grid key=v1,v2 ...] [--set key=value ...]
                          [--seeds N] [--best-of-n 1,2,4,8,16]

Each point of the grid is a full pipeline run nested under the sweep's MLflow run (stages a point does not change
are skipped), seed by seed with --seeds; then best-of-n from the SFT model on the same held-out prompts
(rlhflow/evaluation/frontier.py). The frontier goes to reports/sweep/, metrics/sweep_frontier.csv, the sweep's
MLflow run and a Prefect artifact. How points share, fail and resume: docs/prefect.md, Sweeps.
"""

from __future__ import annotations

# A light door: prefect, mlflow, pandas and torch load with the flow (flows/sweep_flow.py), after --help has answered.
import argparse
import sys
import time

from flows import handed_on
from rlhflow.config.params import parse_config_args
from rlhfops.temporary_server import start_temporary_server

__getattr__ = handed_on(__name__, "flows.sweep_flow")


def parse_grid(specs: list[str]) -> dict[str, list[str]]:
    """`key=v1,v2` per spec, into {key: [v1, v2]}."""
    grid: dict[str, list[str]] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep or not key.strip() or not values.strip():
            raise ValueError(f"--grid {spec!r}: expected key=value1,value2,...")
        grid[key.strip()] = [v.strip() for v in values.split(",") if v.strip()]
    return grid


def parse_best_of_n(text: str) -> list[int]:
    """`--best-of-n`: comma-separated n, sorted and each once; 'none': no baseline."""
    text = text.strip().lower()
    return [] if text == "none" else sorted({int(n) for n in text.split(",") if n.strip()})


def main(argv: list[str] | None = None) -> None:
    """The command line; the flow, Prefect, MLflow and the models' stack are loaded once it is parsed."""
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument(
        "--grid", action="append", default=[], help="key=v1,v2,... (repeat for a grid of several keys; required)"
    )
    own.add_argument(
        "--seeds", type=int, default=1, help="training seeds per point: seed, seed + 1, ... (default 1: seed alone)"
    )
    own.add_argument(
        "--best-of-n",
        default=None,  # None: the flow's DEFAULT_BEST_OF_N
        help="n of the best-of-n baseline; 'none' for no baseline",
    )
    cfg, args = parse_config_args(
        argv,
        "Run a grid of pipeline runs and draw the reward-KL frontier against best-of-n; the best point is chosen "
        "on the dev split.",
        parents=(own,),
    )
    if not args.grid:
        own.error("at least one --grid key=v1,v2 is needed (--help lists the options and the params.yaml keys)")
    if args.seeds < 1:
        own.error(f"--seeds must be at least 1, got {args.seeds}")
    ns = None if args.best_of_n is None else parse_best_of_n(args.best_of_n)
    grid = parse_grid(args.grid)
    from flows.sweep_flow import DEFAULT_BEST_OF_N, rlhf_sweep
    from rlhfops.tracking import stored_config

    start = time.perf_counter()
    start_temporary_server()
    best_of_n = DEFAULT_BEST_OF_N if ns is None else ns
    rlhf_sweep(grid=grid, config=stored_config(cfg), best_of_n=best_of_n, seeds=args.seeds)
    print(f"{'sweep wall time':44s} {time.perf_counter() - start:9.1f}s")


if __name__ == "__main__":
    main(sys.argv[1:])
