"""The sweep's Prefect flow, `rlhf_sweep`: what `python -m flows.sweep` runs once its command line is parsed
(flows/sweep.py, the command, hands every name here on). The grid's points as pipeline runs nested under the sweep's
MLflow run, seed by seed; the best-of-n baseline from the SFT model; the frontier's table, plot and CSV, and the best
point chosen on the dev split. How points share, fail and resume: flows/sweep.py's docstring and docs/prefect.md.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import time
from dataclasses import dataclass, field

import mlflow
import numpy as np
import pandas as pd
from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows import report
from flows.pipeline_flow import rlhf_pipeline, with_overrides
from rlhflow.config.params import Config
from rlhflow.data.splits import conversation_key
from rlhflow.evaluation import plots
from rlhflow.evaluation.frontier import (
    FrontierPoint,
    best_of_n_frontier,
    frontier_plot,
    frontier_table,
    objective_name,
    sample_best_of_n_scores,
)
from rlhflow.evaluation.held_out import evaluation_prompts
from rlhflow.evaluation.stats import across_seeds
from rlhflow.fsutil import atomic_file, write_json_atomic, write_text_atomic
from rlhflow.models.loading import load_causal_lm, load_tokenizer, pick_device
from rlhflow.training.reward_model import RewardModel
from rlhfops import tracking, workspace
from rlhfops.hashing import dir_md5, file_md5, inputs_fingerprint
from tasks.evaluation_setup import evaluation_sampling

DEFAULT_BEST_OF_N = [1, 2, 4, 8, 16]
# what best-of-n reads: the validated test split, the SFT model, the proxy and the judge
BASELINE_STAGES = ["demo_data", "validate", "sft", "reward_model", "judge"]
FRONTIER_CSV = "sweep_frontier.csv"  # in metrics_dir: the data behind the DVC plot (rlhfops/stages.py PLOTS)
REPORT_DIR = "reports/sweep"
SWEEP_TAG = "sweep"


POINT_TAG = "sweep.point"  # on each point's pipeline run: the grid point (its overrides), seeds grouped by it
SEED_TAG = "sweep.seed"
# the best point: the highest of this on the dev split (mean over its seeds); the first one present
CHOICE_METRICS = ("dev/judge_win_rate_both_ended", "dev/judge_win_rate_vs_sft")
# figures shown per point with their across-seed interval
SEED_METRICS = (
    "eval/judge_win_rate_vs_sft",
    "eval/judge_win_rate_both_ended",
    "eval/judge_win_rate_lc",
    "eval/answers_ended",
    "eval/kl",
    "dev/judge_win_rate_both_ended",
)


def point_label(overrides: list[str], seed: int | None = None) -> str:
    """A grid point as it is printed, tagged in MLflow and reported: its overrides (and seed), a URL's credentials
    and secret environment values masked (tracking.redact), as in the sweep run's params."""
    return tracking.redact(", ".join(overrides) + ("" if seed is None else f", seed={seed}"))


@dataclass
class PointOutcome:
    overrides: list[str]  # the grid point's overrides (its seed not included)
    status: str  # finished | reused | failed: <error>
    run_id: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    algorithm: str = "ppo"  # align.algorithm: what made the point's policy
    seed: int | None = None  # the training seed, when the sweep runs several

    @property
    def label(self) -> str:
        return point_label(self.overrides)

    @property
    def run_label(self) -> str:
        return point_label(self.overrides, self.seed)


@dataclass
class SeedGroup:
    """A grid point's runs over the training seeds: each figure's mean and across-seed interval."""

    label: str
    outcomes: list[PointOutcome]

    @property
    def finished(self) -> list[PointOutcome]:
        return [o for o in self.outcomes if not o.status.startswith("failed")]

    def figure(self, key: str) -> tuple[float, float, float]:
        return across_seeds([o.metrics.get(key, float("nan")) for o in self.finished])

    def choice_value(self) -> float:
        for key in CHOICE_METRICS:
            value = self.figure(key)[0]
            if not math.isnan(value):
                return value
        return float("nan")


def seed_groups(outcomes: list[PointOutcome]) -> list[SeedGroup]:
    groups: dict[str, list[PointOutcome]] = {}
    for o in outcomes:
        groups.setdefault(o.label, []).append(o)
    return [SeedGroup(label, members) for label, members in groups.items()]


def best_point(groups: list[SeedGroup]) -> SeedGroup | None:
    """The point with the highest dev-split choice figure (CHOICE_METRICS), or None when no point has one."""
    scored = [g for g in groups if not math.isnan(g.choice_value())]
    return max(scored, key=lambda g: g.choice_value()) if scored else None


def seed_table(groups: list[SeedGroup]) -> str:
    """Markdown: per point, the seeds that finished and each SEED_METRICS figure as mean (interval)."""

    def cell(v: tuple[float, float, float]) -> str:
        if math.isnan(v[0]):
            return ""
        return f"{v[0]:.3f}" + ("" if math.isnan(v[1]) else f" ({v[1]:.3f} to {v[2]:.3f})")

    lines = [
        "| point | seeds | " + " | ".join(SEED_METRICS) + " |",
        "|---" * (2 + len(SEED_METRICS)) + "|",
    ]
    for g in groups:
        cells = [g.label, f"{len(g.finished)}/{len(g.outcomes)}"] + [cell(g.figure(k)) for k in SEED_METRICS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def seed_metrics(groups: list[SeedGroup]) -> dict[str, float]:
    """The seed table as MLflow metrics of the sweep run: point/<point>/<figure>_{mean,ci_low,ci_high}."""
    out = {}
    for g in groups:
        name = re.sub(r"[^A-Za-z0-9_.\-/ ]", "_", g.label.replace("=", "_").replace(", ", "/"))
        for key in SEED_METRICS:
            mean, low, high = g.figure(key)
            for suffix, value in (("mean", mean), ("ci_low", low), ("ci_high", high)):
                if not math.isnan(value):
                    out[f"point/{name}/{key.replace('/', '_')}_{suffix}"] = value
    return out


def grid_points(grid: dict[str, list[str]]) -> list[list[str]]:
    """Every combination of the grid's values, as `--set`-style overrides, in the order given."""
    keys = list(grid)
    return [[f"{k}={v}" for k, v in zip(keys, values)] for values in itertools.product(*(grid[k] for k in keys))]


def finished_point(cfg: Config):
    """The newest FINISHED whole-pipeline run of exactly this config at a commit whose code is HEAD's
    (tracking.same_code: commits in between that change only docs, tests or benches do not count), or None."""

    client = tracking.client()
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    if experiment is None:
        return None
    query = (
        f"tags.{tracking.PARAMS_DIGEST_TAG} = '{tracking.params_digest(cfg)}' and attributes.status = 'FINISHED' "
        "and attributes.run_name = 'pipeline'"
    )
    head = tracking.git_commit()
    checked: dict[str, bool] = {}
    for run in client.search_runs([experiment.experiment_id], query, order_by=["attributes.start_time DESC"]):
        commit = run.data.tags.get(tracking.GIT_COMMIT_TAG)
        if head is None or commit == head:  # outside a git checkout the params alone decide
            return run
        if commit and checked.setdefault(commit, tracking.same_code(commit, head)):
            return run
    return None


def run_point(cfg: Config, overrides: list[str], sweep_run_id: str, seed: int | None = None) -> PointOutcome:
    label = point_label(overrides, seed)
    client = tracking.client()
    done = finished_point(cfg)
    if done is not None:
        print(f"sweep: {label}: finished before (MLflow run {done.info.run_id}), not rerun")
        outcome = PointOutcome(
            overrides, "reused", done.info.run_id, dict(done.data.metrics), cfg.align.algorithm, seed
        )
    else:
        print(f"sweep: {label}: running")
        try:
            metrics = rlhf_pipeline(config=cfg, parent_run=sweep_run_id)
        except Exception as err:  # reported; the other points go on
            reason = tracking.redact(f"{type(err).__name__}: {err}")
            print(f"sweep: {label}: FAILED: {reason}")
            return PointOutcome(overrides, f"failed: {reason}"[:300], algorithm=cfg.align.algorithm, seed=seed)
        run = client.search_runs(
            [client.get_experiment_by_name(cfg.tracking.experiment).experiment_id],
            f"tags.mlflow.parentRunId = '{sweep_run_id}' and tags.{tracking.PARAMS_DIGEST_TAG} = "
            f"'{tracking.params_digest(cfg)}'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        outcome = PointOutcome(
            overrides, "finished", run[0].info.run_id if run else None, metrics, cfg.align.algorithm, seed
        )
    if outcome.run_id:  # the seeds of one point group under one tag in the MLflow runs view
        client.set_tag(outcome.run_id, POINT_TAG, outcome.label)
        client.set_tag(outcome.run_id, SEED_TAG, str(cfg.seed))
    return outcome


def best_of_n_baseline(cfg: Config, ns: list[int], missing_eos_penalty: float | None, parent_run: str | None = None):
    """Best-of-n points from the SFT model on the evaluation prompts, selected by proxy - missing_eos_penalty *
    not_ended (rlhflow.evaluation.frontier.objective_scores); the samples from the cache when its inputs are the
    same. The workspace's upstream stages are first brought to `cfg` (BASELINE_STAGES: up to date, or run again):
    the last point may have left another seed's proxy, or another grid value's models. The caller holds the
    workspace."""

    rlhf_pipeline(config=cfg, stages=BASELINE_STAGES, parent_run=parent_run)

    test = cfg.path(cfg.validate_.out_dir) / "test.jsonl"
    model_dirs = [cfg.path(d) for d in (cfg.sft.out_dir, cfg.reward_model.out_dir, cfg.judge.out_dir)]
    samples = max(ns)
    key = inputs_fingerprint(
        [],
        models=[dir_md5(d) for d in model_dirs],
        test=file_md5(test),
        samples=samples,
        prompts=[cfg.evaluate.n_prompts, "one per test conversation"],
        sampling=[cfg.eval_temperature, cfg.evaluate.max_new_tokens, cfg.ppo.top_k, cfg.ppo.top_p, cfg.seed],
    )
    cache = cfg.path(cfg.metrics_dir) / ".flow" / "best_of_n.json"
    cached = json.loads(cache.read_text()) if cache.is_file() else {}
    if cached.get("key") == key and {"ended", "clusters"} <= cached.keys():  # older caches lack the ended flags
        print(f"sweep: best-of-{samples} samples of the SFT model from {cache}")
    else:
        cached = {"key": key, **_sample_best_of_n(cfg, samples)}
        write_json_atomic(cache, cached)

    return best_of_n_frontier(
        np.array(cached["proxy"]),
        np.array(cached["judge"]),
        ns,
        ended=np.array(cached["ended"]),
        missing_eos_penalty=missing_eos_penalty,  # selected by the reward PPO optimises
        clusters=cached["clusters"],  # resampled by conversation
    )


def _sample_best_of_n(cfg: Config, samples: int) -> dict[str, list]:
    start = time.perf_counter()
    device = pick_device(cfg.device)
    sft_dir = str(cfg.path(cfg.sft.out_dir))
    tokenizer = load_tokenizer(sft_dir)
    sft = load_causal_lm(sft_dir, pad_token_id=tokenizer.pad_token_id).to(device).eval()
    proxy = RewardModel.load(
        cfg.path(cfg.reward_model.out_dir), batch_size=cfg.reward_model.eval_batch_size, device=device
    )
    judge = RewardModel.load(cfg.path(cfg.judge.out_dir), batch_size=cfg.judge.eval_batch_size, device=device)
    # evaluate's test prompts: one per test conversation
    prompts = list(
        evaluation_prompts(cfg.path(cfg.validate_.out_dir) / "test.jsonl", cfg.evaluate.n_prompts)["prompt_messages"]
    )
    proxy_scores, judge_scores, ended = sample_best_of_n_scores(
        sft, tokenizer, prompts, proxy, judge, evaluation_sampling(cfg), samples
    )
    print(f"sweep: {samples} SFT samples for each of {len(prompts)} prompts in {time.perf_counter() - start:.0f} s")
    return {
        "proxy": proxy_scores.tolist(),
        "judge": judge_scores.tolist(),
        "ended": ended.tolist(),
        "clusters": [conversation_key(p) for p in prompts],
    }


def policy_point(outcome: PointOutcome, missing_eos_penalty: float | None = None):
    """A finished point on the frontier. Its optimised reward is the frontier's objective, proxy -
    missing_eos_penalty * not_ended: `eval/objective_mean` where the evaluation logged it, otherwise the proxy's mean
    less missing_eos_penalty * (1 - eos_fraction) (exact for the mean; the interval is the proxy's, shifted)."""

    m = outcome.metrics

    def interval(name: str) -> tuple[float, float, float]:
        return m[name], m.get(f"{name}_ci_low", float("nan")), m.get(f"{name}_ci_high", float("nan"))

    if missing_eos_penalty is None:
        optimised = interval("eval/reward_mean")
    elif "eval/objective_mean" in m:
        optimised = interval("eval/objective_mean")
    else:
        # mean of (proxy - penalty * not_ended) = mean proxy - penalty * (1 - share ended)
        shift = missing_eos_penalty * (1 - m.get("eval/eos_fraction", float("nan")))
        optimised = tuple(v - shift for v in interval("eval/reward_mean"))

    extra_keys = [
        "eval/judge_win_rate_vs_sft",
        "eval/judge_win_rate_lc",
        "eval/judge_win_rate_lc_ci_low",
        "eval/judge_win_rate_lc_ci_high",
        "eval/eos_fraction",
        "eval/response_length",
    ]
    extra = {k.removeprefix("eval/"): m[k] for k in extra_keys if k in m}
    return FrontierPoint(
        outcome.algorithm,
        outcome.label,
        m["eval/kl"],
        optimised,
        interval("eval/judge_reward_mean"),
        extra,
    )


def group_point(group: SeedGroup, missing_eos_penalty: float | None = None):
    """A grid point on the frontier: its one run's point, or with several seeds the mean of each coordinate and the
    across-seed interval of each reward."""

    per_seed = [policy_point(o, missing_eos_penalty) for o in group.finished if "eval/kl" in o.metrics]
    if len(group.outcomes) == 1:
        return per_seed[0] if per_seed else None
    if not per_seed:
        return None
    extras = sorted({k for p in per_seed for k in (p.extra or {})})
    extra = {k: across_seeds([(p.extra or {}).get(k, math.nan) for p in per_seed])[0] for k in extras}
    return FrontierPoint(
        per_seed[0].method,
        f"{group.label} ({len(per_seed)} seeds)",
        float(sum(p.kl for p in per_seed) / len(per_seed)),
        across_seeds([p.proxy_reward[0] for p in per_seed]),
        across_seeds([p.judge_reward[0] for p in per_seed]),
        extra | {"seeds": float(len(per_seed))},
    )


def write_frontier(cfg: Config, outcomes: list[PointOutcome], baseline: list) -> tuple[str, list]:
    """The frontier's table, plot and CSV, on the objective proxy - cfg.ppo.missing_eos_penalty * not_ended;
    returns the markdown and the files written."""

    penalty = cfg.ppo.missing_eos_penalty
    objective = objective_name(penalty)
    groups = seed_groups(outcomes)
    points = baseline + [p for p in (group_point(g, penalty) for g in groups) if p is not None]
    report_dir = cfg.path(REPORT_DIR)
    report_dir.mkdir(parents=True, exist_ok=True)
    csv = cfg.path(cfg.metrics_dir) / FRONTIER_CSV
    write_text_atomic(csv, pd.DataFrame([p.row() for p in points]).to_csv(index=False))
    fig = frontier_plot(points, objective)
    with atomic_file(report_dir / "frontier.png", binary=True) as png:  # the writes rule, as for every output
        fig.savefig(png, format="png", dpi=110)
    plots.close(fig)
    markdown = frontier_markdown(points, objective, groups, outcomes)
    write_text_atomic(report_dir / "frontier.md", markdown)
    return markdown, [csv, report_dir / "frontier.png", report_dir / "frontier.md"]


def frontier_markdown(points: list, objective: str, groups: list, outcomes: list[PointOutcome]) -> str:
    """frontier.md: the frontier's table, each point over its seeds, the best point chosen on the dev split, and
    every run's status."""

    several_seeds = any(len(g.outcomes) > 1 for g in groups)
    failed = [o for o in outcomes if o.status.startswith("failed")]
    best = best_point(groups)
    choice = (
        f"Best point, chosen on the dev split ({CHOICE_METRICS[0]}, else {CHOICE_METRICS[1]}; mean over seeds): "
        f"**{best.label}** at {best.choice_value():.3f}. Its test figures above are reported, not chosen on."
        if best
        else "No point has a dev-split figure (validate.dev_fraction 0?): no best point is chosen."
    )
    seeds_note = (
        "Policy points with several seeds show each figure's mean over the seeds and the across-seed 95% interval "
        "(Student t); "
        if several_seeds
        else ""
    )
    lines = [
        "# Sweep: reward against KL to the SFT model",
        "",
        frontier_table(points, objective),
        "",
        f"Rewards are the mean normalised scores on the held-out evaluation prompts, with 95% bootstrap intervals "
        f"(best-of-n's resampled by conversation). The optimised reward is the one PPO maximises before its KL "
        f"term, `{objective}`: best-of-n selects by it (the KL term is the same for every candidate) and is at its "
        "analytic KL, log n - (n-1)/n. `judge_win_rate_lc` is the judge's length-controlled win rate against the "
        "SFT model, fitted on the same hard verdicts as `judge_win_rate_vs_sft`. " + seeds_note,
        "",
        "## Per point, over its seeds",
        "",
        seed_table(groups),
        "",
        choice,
        "",
        "| point | status | MLflow run |",
        "|---|---|---|",
        *[f"| {o.run_label} | {o.status} | {o.run_id or ''} |" for o in outcomes],
        "",
        *([f"{len(failed)} point(s) failed; the others are in the table.", ""] if failed else []),
        "![frontier](frontier.png)",
    ]
    return "\n".join(lines)


def log_sweep_results(base: Config, sweep, outcomes: list[PointOutcome], baseline: list) -> str:
    """The frontier's files, the points' run ids, the report as the run's note, the counts and the best point, on
    the sweep's MLflow run; returns the report."""

    markdown, files = write_frontier(base, outcomes, baseline)
    for path in files:
        mlflow.log_artifact(str(path), artifact_path="frontier")
    mlflow.set_tag("sweep.points", ",".join(o.run_id for o in outcomes if o.run_id))
    uri = tracking.tracking_uri(base)
    print(
        f"sweep run: {report.mlflow_run_url(uri, sweep.info.experiment_id, sweep.info.run_id)}; its points, "
        f"grouped by tag {POINT_TAG}: {report.mlflow_experiment_url(uri, sweep.info.experiment_id)}"
    )
    mlflow.set_tag("mlflow.note.content", markdown.split("![frontier]")[0])
    finished = [o for o in outcomes if not o.status.startswith("failed")]
    mlflow.log_metrics(
        {"sweep/points_finished": len(finished), "sweep/points_failed": len(outcomes) - len(finished)}
        | seed_metrics(seed_groups(outcomes))
    )
    best = best_point(seed_groups(outcomes))
    if best is not None:
        mlflow.set_tag("sweep.best_point", best.label)
    return markdown


# what every point runs with besides the sweep's overrides and its grid values: the best point is chosen on the dev
# split, so every point answers it up front. A bench that finds a sweep's runs by their params builds them alike.
POINT_OVERRIDES = ("evaluate.dev_figures=true",)


def sweep_points(config: Config | None, overrides: list[str] | None, grid: dict[str, list[str]], seeds: int):
    """(the sweep's base config, its points as (grid values, seed or None), each point's config), seed by seed: the
    stages a seed changes and a point does not (the reward model, the SFT samples) train once per seed and the
    seed's other points find them up to date. A bad key or value fails here, before any work."""
    base = with_overrides(config, [*(overrides or []), *POINT_OVERRIDES])
    if seeds < 1:
        raise ValueError(f"seeds must be at least 1, got {seeds}")
    runs = [(point, None if seeds == 1 else base.seed + i) for i in range(seeds) for point in grid_points(grid)]
    configs = [with_overrides(base, point + ([] if seed is None else [f"seed={seed}"])) for point, seed in runs]
    return base, runs, configs


@flow(name="rlhf-sweep", log_prints=True)
def rlhf_sweep(
    grid: dict[str, list[str]],
    overrides: list[str] | None = None,
    best_of_n: list[int] | None = None,
    config: Config | None = None,
    seeds: int = 1,
) -> list[dict]:
    """A grid of pipeline runs and the reward-KL frontier against best-of-n from the SFT model.

    Args:
        grid: params.yaml keys and the values to try, e.g. {"ppo.kl_coef": ["0.02", "0.05", "0.1", "0.2"]}
        overrides: params.yaml overrides for every point, e.g. ["ppo.steps=10"]
        best_of_n: the n of the best-of-n baseline (default 1, 2, 4, 8, 16); empty list: no baseline
        config: every hyperparameter (params.yaml; its values are the defaults)
        seeds: training seeds per point (seed, seed + 1, ...); the splits and the judge stay fixed
    """

    base, runs, configs = sweep_points(config, overrides, grid, seeds)
    ns = DEFAULT_BEST_OF_N if best_of_n is None else sorted(set(best_of_n))
    tracking.preflight(base)  # and so does a tracking store that cannot be used or must not get the credentials
    with workspace.exclusive(f"sweep over {', '.join(grid)}"):
        tracking.setup(base)
        params = {"grid": {k: ",".join(v) for k, v in grid.items()}, "seeds": seeds}
        with tracking.start_run(base, name="sweep", params=params, tags={SWEEP_TAG: "rlhf"}) as sweep:
            outcomes = [run_point(cfg, point, sweep.info.run_id, seed) for cfg, (point, seed) in zip(configs, runs)]
            finished = [o for o in outcomes if not o.status.startswith("failed")]
            penalty = base.ppo.missing_eos_penalty  # the frontier's one objective, as write_frontier's
            baseline = best_of_n_baseline(configs[0], ns, penalty, sweep.info.run_id) if ns and finished else []
            markdown = log_sweep_results(base, sweep, outcomes, baseline)
    try:
        create_markdown_artifact(markdown, key="rlhf-sweep", description="Sweep: the reward-KL frontier")
    except Exception as err:  # the sweep's results are on disk and in MLflow either way
        print(f"could not publish the sweep report: {err}")
    print(markdown.split("![frontier]")[0])
    failed = [o.label for o in outcomes if o.status.startswith("failed")]
    if failed and not finished:
        raise RuntimeError(f"every point of the sweep failed: {failed}")
    return [{"point": o.label, "seed": o.seed, "status": o.status, "run_id": o.run_id} for o in outcomes]
