"""PPO, GRPO, RLOO and DPO compared like for like on the same validated data, judged by the same evaluation.

    .venv/bin/python -m bench.align_compare --betas 0.4,1,2.5 --seeds 3   # each beta curve, 3 training seeds
    .venv/bin/python -m bench.align_compare --algorithms ppo,grpo         # one point each, default beta
    .venv/bin/python -m bench.align_compare --dpo-equal-time              # and DPO again, given PPO's wall time
    .venv/bin/python -m bench.align_compare --best-of-n 1,2,4,8,16 ...    # and the points against best-of-n
    .venv/bin/python -m bench.align_compare --algorithms ppo,rloo --seeds 3 --set-for rloo:align.learning_rate=1e-5 \\
        --paired                                                          # rloo's own lr; per-seed differences

How it measures: docs/benchmark-methods.md#align_compare.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from dataclasses import dataclass

from rlhflow.config.align import training_budget
from rlhflow.config.params import Config, add_overrides_argument, load_config

# A light door: MLflow, Prefect, scipy and matplotlib (tracking, the sweep, the plots) are imported where used.

ALGORITHMS = ["ppo", "grpo", "rloo", "dpo"]
ONLINE = ("ppo", "grpo", "rloo")
REPORT = "reports/align_compare.md"
PLOT = "reports/align_compare.png"  # judge win rate against KL, one curve per algorithm
FRONTIER_REPORT = "reports/align_frontier.md"  # with --best-of-n: the points against best-of-n
FRONTIER_PLOT = "reports/align_frontier.png"
# each online algorithm: 160 responses, 40 prompts, 40 optimiser steps on params.yaml's ppo and align sections
EQUAL_BUDGET: dict[str, list[str]] = {
    "ppo": ["ppo.samples_per_prompt=4"],
    "grpo": ["align.steps=40", "align.batch_size=4", "align.steps_per_generation=2"],
    "rloo": ["align.steps=40", "align.batch_size=4", "align.steps_per_generation=2"],
    "dpo": [],
}
BETA_KEYS = {"ppo": "ppo.kl_coef", "grpo": "align.grpo.beta", "rloo": "align.rloo.beta", "dpo": "align.dpo.beta"}
FIGURES = [  # (column, metric, its interval's name)
    ("judge win rate", "eval/judge_win_rate_vs_sft", "eval/judge_win_rate"),
    ("judge win rate, both ended", "eval/judge_win_rate_both_ended", None),
    ("proxy reward", "eval/reward_mean", None),
    ("KL to SFT", "eval/kl", None),
    ("ended share", "eval/answers_ended", None),
    ("answer tokens", "eval/answer_tokens", None),
]


@dataclass
class Point:
    algorithm: str
    beta: str
    seed: int | None
    overrides: list[str]
    cfg: Config

    def budget(self) -> dict[str, int]:
        return training_budget(self.algorithm, self.cfg.ppo, self.cfg.align)


def algorithm_overrides(algorithm: str, overrides: list[str], own: dict[str, list[str]] | None = None) -> list[str]:
    """Every point's overrides (the sweep's own too), the algorithm and its equal budget, then the algorithm's own
    (`--set-for`)."""
    from flows.sweep import POINT_OVERRIDES  # the sweep's own point settings (it loads the stack)

    return [
        *overrides,
        *POINT_OVERRIDES,
        f"align.algorithm={algorithm}",
        *EQUAL_BUDGET[algorithm],
        *(own or {}).get(algorithm, []),
    ]


def betas(algorithm: str, overrides: list[str], scales: list[float], own: dict[str, list[str]] | None = None):
    """The algorithm's KL weights: its default (with the overrides) times each scale."""
    cfg = load_config(overrides=algorithm_overrides(algorithm, overrides, own))
    default = functools.reduce(getattr, BETA_KEYS[algorithm].split("."), cfg)
    return [f"{default * s:.4g}" for s in scales]


def make_points(
    algorithms: list[str],
    overrides: list[str],
    scales: list[float],
    seeds: int,
    own: dict[str, list[str]] | None = None,
) -> list[Point]:
    """Every point the comparison runs, as the sweep runs it (seed, seed + 1, ... when seeds > 1); `own`: each
    algorithm's own overrides."""
    base_seed = load_config(overrides=overrides).seed
    points = []
    for algorithm in algorithms:
        for beta in betas(algorithm, overrides, scales, own):
            for i in range(seeds):
                seed = None if seeds == 1 else base_seed + i
                extra = [f"{BETA_KEYS[algorithm]}={beta}"] + ([] if seed is None else [f"seed={seed}"])
                full = algorithm_overrides(algorithm, overrides, own) + extra
                points.append(Point(algorithm, beta, seed, full, load_config(overrides=full)))
    return points


def check_equal_budgets(points: list[Point]) -> dict[str, int]:
    """The online algorithms' common budget; exits naming each point's budget when they differ."""
    budgets = {(p.algorithm, p.beta): p.budget() for p in points if p.algorithm in ONLINE}
    distinct = {tuple(sorted(b.items())) for b in budgets.values()}
    if len(distinct) > 1:
        listed = "; ".join(f"{a} beta {beta}: {b}" for (a, beta), b in budgets.items())
        raise SystemExit(f"the algorithms' budgets differ, nothing was run: {listed}")
    return dict(distinct.pop()) if distinct else {}


def _pipeline_runs(cfg: Config, digests: set[str]) -> dict[str, tuple[object, object]]:
    """params_md5 -> (the newest finished pipeline run, its ppo stage run), for the digests asked for (a stage run
    is looked up for those only)."""
    from rlhfops import tracking

    tracking.setup(cfg)
    client = tracking.client()
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
        if digest not in digests or digest in found or "eval/kl" not in run.data.metrics:
            continue
        stage = client.search_runs(
            [experiment.experiment_id],
            f"tags.mlflow.parentRunId = '{run.info.run_id}' and tags.stage = 'ppo'",
            max_results=1,
        )
        found[digest] = (run, stage[0] if stage else None)
    return found


def _figure(metrics: list[dict], name: str, interval: str | None) -> tuple[float, float, float]:
    """(value, low, high). One seed: the figure and its bootstrap interval (where it has one; else the figure
    three times); several: the mean over seeds and its Student-t interval."""
    from rlhflow.evaluation.stats import across_seeds

    values = [m.get(name, math.nan) for m in metrics]
    if len(metrics) > 1:
        return across_seeds(values)
    interval = interval or name
    m = metrics[0]
    return values[0], m.get(f"{interval}_ci_low", values[0]), m.get(f"{interval}_ci_high", values[0])


def _cell(metrics: list[dict], name: str, interval: str | None) -> str:
    value, low, high = _figure(metrics, name, interval)
    if len(metrics) == 1 and f"{interval or name}_ci_low" not in metrics[0]:
        return f"{value:.3f}"
    return f"{value:.3f} ({low:.3f} to {high:.3f})"


def _groups(points: list[Point]):
    """Per (algorithm, beta), in the points' order: its points and the finished runs found for them (pipeline run,
    ppo stage run)."""
    from rlhfops import tracking

    if not points:  # e.g. the curves of a DPO-only comparison: no online algorithm
        return
    with_digests = [(p, tracking.params_digest(p.cfg)) for p in points]
    runs = _pipeline_runs(points[0].cfg, {digest for _, digest in with_digests})
    groups: dict[tuple[str, str], list[tuple[Point, str]]] = {}
    for p, digest in with_digests:
        groups.setdefault((p.algorithm, p.beta), []).append((p, digest))
    for (algorithm, beta), members in groups.items():
        found = [runs[digest] for _, digest in members if digest in runs]
        yield algorithm, beta, [p for p, _ in members], found


def table(points: list[Point]) -> str:
    head = ["algorithm", "beta", "seeds", "responses", "prompts", "optimizer steps", "ppo stage (s)"]
    head += [column for column, _, _ in FIGURES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for algorithm, beta, group, found in _groups(points):
        b = group[0].budget()
        row = [algorithm, beta, f"{len(found)}/{len(group)}", b["responses"], b["prompts"], b["optimizer_steps"]]
        if not found:
            lines.append("| " + " | ".join(map(str, row)) + " | no finished run |" + " |" * (len(FIGURES) - 1))
            continue
        walls = [s.data.metrics.get("time/ppo_s", math.nan) for _, s in found if s is not None]
        row.append(f"{sum(walls) / len(walls):.0f}" if walls else "n/a")
        metrics = [run.data.metrics for run, _ in found]
        row += [_cell(metrics, name, interval) for _, name, interval in FIGURES]
        lines.append("| " + " | ".join(map(str, row)) + " |")
    return "\n".join(lines)


PAIRED_FIGURES = [  # (row, metric, decimals): dev first, where a choice between algorithms is read
    ("dev: judge win rate, both ended", "dev/judge_win_rate_both_ended", 3),
    ("dev: judge win rate", "dev/judge_win_rate_vs_sft", 3),
    ("test: judge win rate, both ended", "eval/judge_win_rate_both_ended", 3),
    ("test: judge win rate", "eval/judge_win_rate_vs_sft", 3),
    ("test: KL to SFT, nats", "eval/kl", 2),
    ("test: answers ended", "eval/answers_ended", 3),
    ("test: answer tokens, mean", "eval/answer_tokens", 0),
    ("test: judge reward", "eval/judge_reward_mean", 3),
]


def paired_table(points: list[Point]) -> str:
    """Per figure, each point's value at each seed, then their mean and 95% Student-t interval; and each point's
    difference from the first point's at the same seed (the seeds both have), the same way. At one seed the
    proxy reward model and the SFT answers are the same for every algorithm, so the differences are paired."""
    from rlhflow.evaluation.stats import across_seeds

    columns = []
    for algorithm, beta, _, found in _groups(points):
        by_seed = {int(run.data.params["seed"]): run.data.metrics for run, _ in found}
        columns.append((f"{algorithm} {beta}", dict(sorted(by_seed.items()))))
    if not columns:
        return "no finished run"

    def summary(values: list[float], decimals: int, each: bool) -> str:
        shown = ", ".join(f"{v:.{decimals}f}" for v in values) if each else ""
        if len(values) < 2:
            return shown or (f"{values[0]:.{decimals}f}" if values else "")
        mean, low, high = across_seeds(values)
        interval = f"{mean:.{decimals}f} ({low:.{decimals}f} to {high:.{decimals}f})"
        return f"{shown}; {interval}" if each else interval

    (first, reference), others = columns[0], columns[1:]
    head = ["figure", *(label for label, _ in columns), *(f"{label} - {first}" for label, _ in others)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row, metric, decimals in PAIRED_FIGURES:
        cells = [row]
        cells += [summary([m.get(metric, math.nan) for m in seeds.values()], decimals, True) for _, seeds in columns]
        for _, seeds in others:
            common = [s for s in seeds if s in reference]
            differences = [seeds[s].get(metric, math.nan) - reference[s].get(metric, math.nan) for s in common]
            cells.append(summary(differences, decimals, False))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@dataclass
class CurvePoint:
    beta: str
    seeds: int
    kl: tuple[float, float, float]  # (value, low, high), as in the table
    judge_win_rate: tuple[float, float, float]


def curves(points: list[Point]) -> dict[str, list[CurvePoint]]:
    """Per algorithm, its finished points as (KL to SFT, judge win rate) with their intervals, in order of KL: the
    curves the comparison reads at equal KL."""
    out: dict[str, list[CurvePoint]] = {}
    for algorithm, beta, _, found in _groups(points):
        if found:
            metrics = [run.data.metrics for run, _ in found]
            kl = _figure(metrics, "eval/kl", None)
            win = _figure(metrics, "eval/judge_win_rate_vs_sft", "eval/judge_win_rate")
            out.setdefault(algorithm, []).append(CurvePoint(beta, len(found), kl, win))
    return {a: sorted(c, key=lambda p: p.kl[0]) for a, c in out.items()}


def plot(curves_by_algorithm: dict[str, list[CurvePoint]]):
    """Judge win rate against the SFT model over KL to it, one line per algorithm, each point with both intervals and
    its beta."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for algorithm, points in curves_by_algorithm.items():
        kl = [p.kl for p in points]
        win = [p.judge_win_rate for p in points]
        ax.errorbar(
            [k[0] for k in kl],
            [w[0] for w in win],
            xerr=[[k[0] - k[1] for k in kl], [k[2] - k[0] for k in kl]],
            yerr=[[w[0] - w[1] for w in win], [w[2] - w[0] for w in win]],
            fmt="o-",
            capsize=3,
            label=algorithm,
        )
        for p in points:
            ax.annotate(
                f"β={p.beta}", (p.kl[0], p.judge_win_rate[0]), fontsize=7, xytext=(4, -10), textcoords="offset points"
            )
    ax.axhline(0.5, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="KL to the SFT model (nats per answer)", ylabel="judge win rate against the SFT model")
    ax.set_title("Equal budget: judge win rate against KL, test split", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def frontier(points: list[Point], baseline: list, missing_eos_penalty: float | None) -> tuple[str, object]:
    """The points against `baseline` (best-of-n from the SFT model, flows.sweep.best_of_n_baseline): the optimised
    reward (proxy - missing_eos_penalty * not ended) and the judge's over sqrt(KL to SFT), as the sweep's frontier
    draws them, each point's seeds as one (means and across-seed intervals). Returns the Markdown table and the
    figure."""
    from flows.sweep import PointOutcome, SeedGroup, group_point
    from rlhflow.evaluation.frontier import frontier_plot, frontier_table, objective_name

    drawn = list(baseline)
    for algorithm, beta, _, found in _groups(points):
        outcomes = [
            PointOutcome([f"beta={beta}"], "finished", run.info.run_id, dict(run.data.metrics), algorithm)
            for run, _ in found
        ]
        point = group_point(SeedGroup(f"beta={beta}", outcomes), missing_eos_penalty)  # None: no finished run
        if point is not None:
            drawn.append(point)
    objective = objective_name(missing_eos_penalty)
    return frontier_table(drawn, objective), frontier_plot(drawn, objective)


def _save_figure(fig, path) -> None:
    from rlhflow.evaluation import plots
    from rlhflow.fsutil import atomic_file

    with atomic_file(path, binary=True) as f:  # whole or not at all
        fig.savefig(f, dpi=120, format="png")
    plots.close(fig)


def _stage_seconds(points: list[Point]) -> list[float | None]:
    """Per point: the ppo stage's wall time of its newest finished run, None where it has none."""
    from rlhfops import tracking

    digests = [tracking.params_digest(p.cfg) for p in points]
    runs = _pipeline_runs(points[0].cfg, set(digests))
    stages = [runs.get(digest, (None, None))[1] for digest in digests]
    return [s.data.metrics.get("time/ppo_s") if s is not None else None for s in stages]


def dpo_step_times(dpo: Point, max_steps: int) -> dict[int, float]:
    """align.steps -> the DPO stage's wall time, for every step count from 1 to `max_steps` that DPO finished at
    `dpo`'s other settings (its seed included)."""
    candidates = {}
    for n in range(1, max_steps + 1):
        overrides = [*dpo.overrides, f"align.steps={n}"]
        candidates[n] = Point("dpo", dpo.beta, dpo.seed, overrides, load_config(overrides=overrides))
    seconds = _stage_seconds(list(candidates.values()))
    return {n: t for n, t in zip(candidates, seconds) if t is not None}


def dpo_equal_time_steps(points: list[Point]) -> tuple[int, dict[int, float]] | None:
    """align.steps for a DPO run as long as PPO's stage, and DPO's finished step counts with their seconds.

    PPO's wall time is the mean of its points' stage times; DPO's seconds per step are its finished runs' seconds
    over their steps, at the first DPO point's settings and any step count up to 4x its own. DPO's stage is almost
    all steps (at 10 steps on the default pipeline its training loop took 459 of the stage's 464 s), so no fixed
    part is fitted: with steps of uneven length (each batch as long as its longest pair) two or three runs would put
    one anywhere."""
    ppo = [p for p in points if p.algorithm == "ppo"]
    ppo_seconds = [t for t in _stage_seconds(ppo) if t is not None] if ppo else []
    dpo = next((p for p in points if p.algorithm == "dpo"), None)
    if not ppo_seconds or dpo is None:
        return None
    times = dpo_step_times(dpo, 4 * dpo.cfg.align.steps)
    if not times:
        return None
    per_step = sum(times.values()) / sum(times)
    return max(1, round(sum(ppo_seconds) / len(ppo_seconds) / per_step)), times


def own_overrides(specs: list[str], algorithms: list[str], parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """`--set-for ALGORITHM:KEY=VALUE` values, per algorithm."""
    own: dict[str, list[str]] = {}
    for spec in specs:
        algorithm, _, override = spec.partition(":")
        if algorithm not in algorithms or "=" not in override:
            parser.error(f"--set-for {spec!r}: expected ALGORITHM:KEY=VALUE with ALGORITHM one of {algorithms}")
        own.setdefault(algorithm, []).append(override)
    return own


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated align.algorithm values")
    parser.add_argument("--betas", default="1", help="comma-separated multiples of each algorithm's default beta")
    parser.add_argument("--seeds", type=int, default=1, help="training seeds per point")
    parser.add_argument("--dpo-equal-time", action="store_true", help="add DPO at PPO's wall time")
    parser.add_argument("--table-only", action="store_true", help="no runs: the table from MLflow")
    parser.add_argument(
        "--set-for",
        action="append",
        default=[],
        metavar="ALGORITHM:KEY=VALUE",
        help="a params.yaml override for one algorithm's points, e.g. rloo:align.learning_rate=1e-5 (repeatable)",
    )
    parser.add_argument(
        "--paired",
        action="store_true",
        help="also each figure per seed and each algorithm's difference from the first one's at the same seed",
    )
    parser.add_argument(
        "--best-of-n",
        default="none",
        help="comma-separated n: draw the points against best-of-n from the SFT model (reports/align_frontier.*)",
    )
    add_overrides_argument(parser, "params.yaml overrides for every point")
    args = parser.parse_args(argv)
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    unknown = sorted(set(algorithms) - set(ALGORITHMS))
    if unknown:
        parser.error(f"unknown algorithm(s) {unknown}; choose from {ALGORITHMS}")
    scales = [float(s) for s in args.betas.split(",")]
    from flows.sweep import parse_best_of_n

    ns = parse_best_of_n(args.best_of_n)
    own = own_overrides(args.set_for, algorithms, parser)
    points = make_points(algorithms, args.overrides, scales, args.seeds, own)
    budget = check_equal_budgets(points)  # before any work
    print(f"equal budget of {', '.join(a for a in algorithms if a in ONLINE)}: {budget}", flush=True)

    base = load_config(overrides=args.overrides)

    def sweep(algorithm: str, grid: dict[str, list[str]]) -> None:
        from flows.sweep import rlhf_sweep

        overrides = algorithm_overrides(algorithm, args.overrides, own)
        rlhf_sweep(grid=grid, overrides=overrides, best_of_n=[], config=base, seeds=args.seeds)

    if not args.table_only:
        for algorithm in algorithms:  # each algorithm's betas, as make_points made them
            swept = list(dict.fromkeys(p.beta for p in points if p.algorithm == algorithm))
            sweep(algorithm, {BETA_KEYS[algorithm]: swept})
    if args.dpo_equal_time:
        fitted = dpo_equal_time_steps(points)
        if fitted is None:
            sys.exit("--dpo-equal-time needs finished ppo and dpo points first")
        steps, times = fitted
        print(f"DPO at PPO's wall time: {steps} steps (DPO's stage seconds by steps: {times})", flush=True)
        if not args.table_only:
            sweep("dpo", {"align.steps": [str(steps)]})
        default = next(p.cfg.align.steps for p in points if p.algorithm == "dpo")
        for n in sorted({steps, *times} - {default}):  # the equal-time point, then DPO's other step counts
            for p in make_points(["dpo"], [*args.overrides, f"align.steps={n}"], [1.0], args.seeds):
                p.beta = f"{p.beta}, {n} steps" + (" (PPO's wall time)" if n == steps else "")
                points.append(p)

    markdown = table(points)
    if args.paired:
        markdown += "\n\n" + paired_table(points)
    from rlhflow.fsutil import write_text_atomic

    write_text_atomic(base.path(REPORT), markdown + "\n")
    print(markdown)
    online = [p for p in points if p.algorithm in ONLINE]
    found = curves(online)
    if found:
        _save_figure(plot(found), base.path(PLOT))
        print(f"plot: {PLOT}")
    if ns:
        from flows.sweep import best_of_n_baseline
        from rlhfops import workspace

        penalty = base.ppo.missing_eos_penalty  # the objective every point's evaluation reports beside the proxy
        with workspace.exclusive("align_compare: the best-of-n baseline"):
            baseline = best_of_n_baseline(base, ns, penalty)  # its upstream stages brought to `base` first
        markdown, fig = frontier(online, baseline, penalty)
        write_text_atomic(base.path(FRONTIER_REPORT), markdown + "\n")
        _save_figure(fig, base.path(FRONTIER_PLOT))
        print(markdown)
        print(f"frontier: {FRONTIER_REPORT}, {FRONTIER_PLOT}")


if __name__ == "__main__":
    main(sys.argv[1:])
