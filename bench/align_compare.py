"""PPO, GRPO, RLOO and DPO side by side on the same validated data, judged by the same evaluation.

    .venv/bin/python -m bench.align_compare                   # the four at their defaults, then the table
    .venv/bin/python -m bench.align_compare --dpo-equal-time  # and DPO again, given PPO's wall time
    .venv/bin/python -m bench.align_compare --table-only      # the table from the runs already in MLflow

The defaults are an equal budget of generated responses: PPO samples `ppo.steps * ppo.batch_size` responses,
GRPO and RLOO `align.steps * align.batch_size` (in groups of `num_generations`), 160 each on params.yaml. DPO
generates none; `--dpo-equal-time` adds a DPO point whose `align.steps` gives it the wall time of PPO's stage
(from DPO's own seconds per step at its default).

The runs are one sweep over `align.algorithm` (flows/sweep.py: upstream stages shared, finished points reused),
so every algorithm starts from the same SFT model and proxy and is scored by the same judge on the same prompts.
The table (Markdown, on stdout and in `reports/align_compare.md`) takes each point's newest finished pipeline
run: the ppo stage's wall time, the judge's win rate and length-controlled win rate against the SFT model with
95% intervals, the proxy reward, KL to the SFT model, EOS share and answer length.
"""

from __future__ import annotations

import argparse
import math
import sys

from rlhflow.config import Config, add_overrides_argument, load_config

ALGORITHMS = ["ppo", "grpo", "rloo", "dpo"]
REPORT = "reports/align_compare.md"


def generated_responses(cfg: Config) -> int:
    if cfg.align.algorithm == "ppo":
        return cfg.ppo.steps * cfg.ppo.batch_size
    if cfg.align.algorithm == "dpo":
        return 0
    return cfg.align.steps * cfg.align.batch_size


def _pipeline_runs(cfg: Config) -> dict[str, tuple[object, object]]:
    """params_md5 -> (the newest finished pipeline run, its ppo stage run)."""
    import mlflow

    from rlhfops import tracking

    tracking.setup(cfg)
    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    if experiment is None:
        return {}
    found: dict[str, tuple[object, object]] = {}
    for run in client.search_runs(
        [experiment.experiment_id],
        "attributes.run_name = 'pipeline' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
    ):
        digest = run.data.tags.get(tracking.PARAMS_DIGEST_TAG)
        if digest in found or "eval/kl" not in run.data.metrics:
            continue
        stage = client.search_runs(
            [experiment.experiment_id],
            f"tags.mlflow.parentRunId = '{run.info.run_id}' and tags.stage = 'ppo'",
            max_results=1,
        )
        found[digest] = (run, stage[0] if stage else None)
    return found


def _interval(m: dict, name: str, interval: str | None = None) -> str:
    """`name` with its 95% interval, `<interval>_ci_low`/`_ci_high` (default: the name's own)."""
    if name not in m:
        return "n/a"
    interval = interval or name
    low, high = m.get(f"{interval}_ci_low", math.nan), m.get(f"{interval}_ci_high", math.nan)
    return f"{m[name]:.3f} ({low:.3f}-{high:.3f})"


def table(points: list[tuple[str, Config]]) -> str:
    from rlhfops import tracking

    runs = _pipeline_runs(points[0][1])
    lines = [
        "| algorithm | point | responses generated | ppo stage (s) | judge win rate | judge LC win rate "
        "| proxy win rate | proxy reward | KL to SFT | EOS share | answer words |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, cfg in points:
        run, stage = runs.get(tracking.params_digest(cfg), (None, None))
        if run is None:
            lines.append(
                f"| {cfg.align.algorithm} | {label} | {generated_responses(cfg)} | no finished run |" + " |" * 7
            )
            continue
        m = run.data.metrics
        wall = stage.data.metrics.get("time/ppo_s", math.nan) if stage is not None else math.nan
        lines.append(
            f"| {cfg.align.algorithm} | {label} | {generated_responses(cfg)} | {wall:.0f} "
            f"| {_interval(m, 'eval/judge_win_rate_vs_sft', 'eval/judge_win_rate')} "
            f"| {_interval(m, 'eval/judge_win_rate_lc')} "
            f"| {_interval(m, 'eval/win_rate_vs_sft', 'eval/win_rate')} | {_interval(m, 'eval/reward_mean')} "
            f"| {m.get('eval/kl', math.nan):.2f} | {m.get('eval/eos_fraction', math.nan):.2f} "
            f"| {m.get('eval/response_length', math.nan):.1f} |"
        )
    return "\n".join(lines)


def dpo_equal_time_steps(points: list[tuple[str, Config]]) -> int | None:
    """align.steps for a DPO run as long as PPO's stage, from the finished default runs of both."""
    from rlhfops import tracking

    runs = _pipeline_runs(points[0][1])
    seconds = {}
    for _, cfg in points:
        _, stage = runs.get(tracking.params_digest(cfg), (None, None))
        if stage is not None and "time/ppo_s" in stage.data.metrics:
            seconds[cfg.align.algorithm] = (stage.data.metrics["time/ppo_s"], cfg)
    if "ppo" not in seconds or "dpo" not in seconds:
        return None
    ppo_s, dpo = seconds["ppo"][0], seconds["dpo"]
    return max(1, round(ppo_s / (dpo[0] / dpo[1].align.steps)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated align.algorithm values")
    parser.add_argument("--dpo-equal-time", action="store_true", help="add DPO at PPO's wall time")
    parser.add_argument("--table-only", action="store_true", help="no runs: the table from MLflow")
    add_overrides_argument(parser, "params.yaml overrides for every point")
    args = parser.parse_args(argv)
    base = load_config(overrides=args.overrides)
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    points = [
        (f"align.algorithm={a}", load_config(overrides=[*args.overrides, f"align.algorithm={a}"])) for a in algorithms
    ]

    if not args.table_only:
        from flows.sweep import rlhf_sweep

        rlhf_sweep(grid={"align.algorithm": algorithms}, overrides=args.overrides, best_of_n=[], config=base)
    if args.dpo_equal_time:
        steps = dpo_equal_time_steps(points)
        if steps is None:
            sys.exit("--dpo-equal-time needs finished ppo and dpo points first")
        extra = [*args.overrides, "align.algorithm=dpo", f"align.steps={steps}"]
        if not args.table_only:
            from flows.sweep import rlhf_sweep

            rlhf_sweep(grid={"align.steps": [str(steps)]}, overrides=extra[:-1], best_of_n=[], config=base)
        points.append((f"align.algorithm=dpo, align.steps={steps} (PPO's wall time)", load_config(overrides=extra)))

    markdown = table(points)
    from rlhflow.fsutil import write_text_atomic

    write_text_atomic(base.path(REPORT), markdown + "\n")
    print(markdown)


if __name__ == "__main__":
    main(sys.argv[1:])
