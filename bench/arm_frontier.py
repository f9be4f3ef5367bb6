"""Two values of one setting on the reward-KL frontier: the default pipeline with each value ("arm") at each KL weight
and training seed, compared on KL to SFT, the proxy reward PPO optimises, the judge's reward and win rates (both
ended, length-controlled), the answers' ended share and length, and the proxy's accuracy with and without length
control: per seed, as means over seeds, paired by seed, and at equal KL.

    .venv/bin/python -m bench.arm_frontier --setting reward_model.length_head --arms false,true --seeds 3
    .venv/bin/python -m bench.arm_frontier --setting ppo.precision --arms fp32,bf16 --seeds 3 --betas 1,0.5
    .venv/bin/python -m bench.arm_frontier ... --table-only          # the table from MLflow, nothing run
    .venv/bin/python -m bench.arm_frontier ... --table-only --stage reward_model   # a stage's own figures

bench.precision_frontier is this bench for ppo.precision. How it measures: docs/benchmark-methods.md#arm_frontier.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

from bench.align_compare import _pipeline_runs
from rlhflow.config.params import Config, add_overrides_argument, load_config
from rlhflow.fsutil import write_text_atomic

# A light door: scipy, MLflow and Prefect (stats, tracking, the sweep) are imported where used: --help answers at once.

KL = "eval/kl"
# (row, metric, decimals): the figures PPO optimises first, then the judge's, dev before test; win rates and accuracies
# on hard verdicts, the soft scale named where it is shown
FIGURES = [
    ("test: KL to SFT, nats", KL, 2),
    ("test: proxy reward less the missing-EOS penalty (PPO's objective)", "eval/objective_mean", 3),
    ("test: proxy reward", "eval/reward_mean", 3),
    ("test: proxy win rate vs SFT, both ended", "eval/win_rate_both_ended", 3),
    ("test: judge reward", "eval/judge_reward_mean", 3),
    ("dev: judge win rate vs SFT, both ended", "dev/judge_win_rate_both_ended", 3),
    ("test: judge win rate vs SFT, both ended", "eval/judge_win_rate_both_ended", 3),
    ("dev: judge win rate, length-controlled", "dev/judge_win_rate_lc", 3),
    ("test: judge win rate, length-controlled", "eval/judge_win_rate_lc", 3),
    ("test: judge soft preference, length-controlled (soft scale)", "eval/judge_soft_preference_lc", 3),
    ("test: answers ended", "eval/answers_ended", 3),
    ("test: answer tokens, mean", "eval/answer_tokens", 0),
    ("test pairs: proxy accuracy", "rm/accuracy", 3),
    ("test pairs: proxy accuracy, length-controlled", "rm/accuracy_lc", 3),
    ("test pairs: proxy soft accuracy (soft scale)", "rm/soft_accuracy", 3),
    ("test pairs: proxy soft accuracy, length-controlled (soft scale)", "rm/soft_accuracy_lc", 3),
]


@dataclass
class Point:
    arm: str  # the setting's value
    beta: str
    seed: int
    cfg: Config
    metrics: dict | None = None  # the finished pipeline run's, once found


def make_points(setting: str, arms: list[str], overrides: list[str], scales: list[float], seeds: int) -> list[Point]:
    """Every (arm, beta, seed) as the sweep runs it: seeds seed, seed + 1, ...; beta: the default times each
    scale."""
    from flows.sweep import POINT_OVERRIDES  # the sweep's own point settings (it loads the stack)

    base = load_config(overrides=overrides)
    betas = [f"{base.ppo.kl_coef * s:.4g}" for s in scales]
    points = []
    for arm in arms:
        for beta in betas:
            for seed in range(base.seed, base.seed + seeds):
                extra = [f"{setting}={arm}", f"ppo.kl_coef={beta}", f"seed={seed}"]
                points.append(Point(arm, beta, seed, load_config(overrides=[*overrides, *POINT_OVERRIDES, *extra])))
    return points


def find_runs(points: list[Point]) -> None:
    """Each point's newest finished pipeline run, by its parameters' digest."""
    from rlhfops import tracking

    digests = {id(p): tracking.params_digest(p.cfg) for p in points}
    runs = _pipeline_runs(points[0].cfg, set(digests.values()))
    for p in points:
        found = runs.get(digests[id(p)])
        p.metrics = found[0].data.metrics if found else None


def find_stage_runs(points: list[Point], stage: str) -> None:
    """Each point's figures from the newest finished `stage` run under a finished pipeline run of its parameters: a
    pipeline run of some stages (`--stages validate,sft,reward_model`) logs their figures on their own runs only."""
    from rlhfops import tracking

    tracking.setup(points[0].cfg)
    client = tracking.client()
    experiment = client.get_experiment_by_name(points[0].cfg.tracking.experiment)
    finished = "attributes.status = 'FINISHED'"
    for p in points:
        p.metrics = None
        if experiment is None:
            continue
        digest = f"tags.{tracking.PARAMS_DIGEST_TAG} = '{tracking.params_digest(p.cfg)}'"
        for parent in client.search_runs(
            [experiment.experiment_id],
            f"{digest} and {finished}",  # a pipeline run of any stages (its name lists them)
            order_by=["attributes.start_time DESC"],
        ):
            child = f"tags.mlflow.parentRunId = '{parent.info.run_id}' and tags.stage = '{stage}' and {finished}"
            runs = client.search_runs([experiment.experiment_id], child)
            if runs:
                p.metrics = runs[0].data.metrics
                break


def _summary(values: list[float], decimals: int) -> str:
    from rlhflow.evaluation.stats import across_seeds

    shown = ", ".join(f"{v:.{decimals}f}" for v in values)
    if len(values) < 2:
        return shown
    mean, low, high = across_seeds(values)
    return f"{shown}; mean {mean:.{decimals}f} ({low:.{decimals}f} to {high:.{decimals}f})"


def _interval(value: tuple[float, float, float], decimals: int) -> str:
    mean, low, high = value
    return f"{mean:.{decimals}f} ({low:.{decimals}f} to {high:.{decimals}f})"


def table(points: list[Point]) -> str:
    """Per figure: each (arm, beta)'s value at each seed with the mean and its 95% Student-t interval; the second arm
    less the first paired by seed at each beta; and the same difference at equal KL over every run
    (`difference_at_equal_x`)."""
    from rlhflow.evaluation.stats import across_seeds, difference_at_equal_x

    done = [p for p in points if p.metrics is not None]
    missing = [f"{p.arm} beta {p.beta} seed {p.seed}" for p in points if p.metrics is None]
    if not done:
        return f"No finished run yet: {', '.join(missing)}."
    first, second = list(dict.fromkeys(p.arm for p in points))[:2]
    groups = list(dict.fromkeys((p.arm, p.beta) for p in done))
    betas = [b for b in dict.fromkeys(p.beta for p in done) if (first, b) in groups and (second, b) in groups]
    head = ["figure", *(f"{arm}, beta {beta}" for arm, beta in groups)]
    head += [f"{second} - {first}, beta {beta}, paired by seed" for beta in betas] + [f"{second} - {first} at equal KL"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by_key = {(p.arm, p.beta, p.seed): p.metrics for p in done}
    for row, metric, decimals in FIGURES:
        if all(metric not in p.metrics for p in done):
            continue  # a figure no run has (a stage's own figures: no evaluation)
        cells = [row]
        for arm, beta in groups:
            values = [p.metrics.get(metric, math.nan) for p in done if (p.arm, p.beta) == (arm, beta)]
            cells.append(_summary(values, decimals))
        for beta in betas:
            seeds = sorted({s for (a, b, s) in by_key if b == beta and a == first and (second, b, s) in by_key})
            pairs = [
                by_key[second, beta, s].get(metric, math.nan) - by_key[first, beta, s].get(metric, math.nan)
                for s in seeds
            ]
            cells.append(_interval(across_seeds(pairs), decimals) if len(pairs) > 1 else "")
        if metric == KL or all(KL not in p.metrics for p in done):
            cells.append("")
        else:
            x = [p.metrics.get(KL, math.nan) for p in done]
            y = [p.metrics.get(metric, math.nan) for p in done]
            cells.append(_interval(difference_at_equal_x(x, y, [p.arm == second for p in done]), decimals))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + (f"\n\nNo finished run yet: {', '.join(missing)}." if missing else "")


def main(argv: list[str] | None = None, *, setting: str | None = None, arms: str | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", default=setting, required=setting is None, help="the params.yaml key compared")
    parser.add_argument("--arms", default=arms, required=arms is None, help="its two values, comma-separated")
    parser.add_argument("--betas", default="1", help="comma-separated multiples of the default ppo.kl_coef")
    parser.add_argument("--seeds", type=int, default=3, help="training seeds per point")
    parser.add_argument("--table-only", action="store_true", help="no runs: the table from MLflow")
    parser.add_argument("--stage", default=None, help="the table of this stage's own figures (its stage runs)")
    add_overrides_argument(parser, "params.yaml overrides for every point")
    args = parser.parse_args(argv)
    arm_values = args.arms.split(",")
    if len(arm_values) != 2:
        parser.error(f"--arms takes two values, got {args.arms!r}")
    points = make_points(
        args.setting, arm_values, args.overrides, [float(s) for s in args.betas.split(",")], args.seeds
    )
    if not args.table_only:
        from flows.sweep import rlhf_sweep

        grid = {args.setting: arm_values, "ppo.kl_coef": list(dict.fromkeys(p.beta for p in points))}
        base = load_config(overrides=args.overrides)
        rlhf_sweep(grid=grid, overrides=args.overrides, best_of_n=[], config=base, seeds=args.seeds)
    find_stage_runs(points, args.stage) if args.stage else find_runs(points)
    markdown = table(points)
    write_text_atomic(points[0].cfg.path(f"reports/frontier_{args.setting.replace('.', '_')}.md"), markdown + "\n")
    print(markdown)


if __name__ == "__main__":
    main(sys.argv[1:])
