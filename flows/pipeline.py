"""The full RLHF pipeline as one Prefect flow: the stages of rlhflow.stages.STAGES, in order, inside one
MLflow parent run (one child run per stage). Run it with

    python -m flows.pipeline [--params params.yaml] [--set ppo.kl_coef=0.1 ...] [--stages ppo,evaluate]

or from the Prefect UI (see `make ui`). A failing stage fails the flow, marks the parent run FAILED and
stops everything downstream.
"""

from __future__ import annotations

import importlib
import sys
import time

from prefect import flow

from rlhflow import tracking
from rlhflow.config import Config, load_config
from rlhflow.stages import STAGE_NAMES, STAGES
from tasks._common import parse_args
from tasks.demo_data import uses_demo_data

SUMMARY_METRICS = [
    ("rm/accuracy", "reward model accuracy (held-out pairs)"),
    ("rm/accuracy_hh", "reward model accuracy (hh-rlhf harmless)"),
    ("eval/reward_mean", "reward, PPO policy"),
    ("eval/reward_mean_sft", "reward, SFT model"),
    ("eval/win_rate_vs_sft", "win rate vs SFT"),
    ("eval/kl", "KL(policy || SFT), nats/response"),
    ("eval/perplexity", "perplexity, PPO policy"),
    ("eval/perplexity_sft", "perplexity, SFT model"),
]


def selected_stages(cfg: Config, stages: list[str] | None) -> list[str]:
    names = list(stages) if stages else [s.name for s in STAGES]
    unknown = [n for n in names if n not in STAGE_NAMES]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; stages: {STAGE_NAMES}")
    if "demo_data" in names and not uses_demo_data(cfg):
        names.remove("demo_data")  # the user brought their own data
    return names


@flow(name="rlhf-pipeline", log_prints=True)
def rlhf_pipeline(overrides: list[str] | None = None, params_file: str | None = None,
                  stages: list[str] | None = None) -> dict[str, float]:
    """validate -> sft -> reward_model -> ppo -> evaluate on params.yaml plus `overrides` (key=value)."""
    cfg = load_config(params_file, overrides)
    names = selected_stages(cfg, stages)
    results: dict[str, float] = {}
    with tracking.pipeline_run(cfg) as parent:
        parent_id = parent.info.run_id
        print(f"MLflow parent run {parent_id} in experiment {cfg.tracking.experiment!r} at {tracking.tracking_uri(cfg)}")
        for name in names:
            module = importlib.import_module(f"tasks.{name}")
            results.update(module.task(cfg, parent_id))
        tracking.log_metrics({k: v for k, v in results.items() if k.startswith("time/")})
    print(summary_table(results))
    return results


def summary_table(results: dict[str, float]) -> str:
    lines = ["", "RLHF pipeline summary", "-" * 60]
    for key, label in SUMMARY_METRICS:
        if key in results:
            lines.append(f"{label:44s} {results[key]:10.4f}")
    lines.append("-" * 60)
    for key, value in results.items():
        if key.startswith("time/"):
            lines.append(f"{'wall time, ' + key[5:-2]:44s} {value:9.1f}s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--stages", default=None, help="comma-separated subset of stages to run")
    known, rest = pre.parse_known_args(argv)
    cfg, args = parse_args(rest, "Run the RLHF pipeline flow (validate -> sft -> reward_model -> ppo -> evaluate).")
    start = time.perf_counter()
    stages = known.stages.split(",") if known.stages else None
    rlhf_pipeline(overrides=args.overrides, params_file=args.params, stages=stages)
    print(f"{'total wall time':44s} {time.perf_counter() - start:9.1f}s")


if __name__ == "__main__":
    main(sys.argv[1:])
