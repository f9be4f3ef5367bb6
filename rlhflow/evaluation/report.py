"""The evaluate stage's written outputs: the report (report.md), the DVC plot tables and the figures."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from rlhflow.evaluation import plots
from rlhflow.fsutil import atomic_dir, write_json_atomic, write_text_atomic
from rlhflow.models.sampling import Sampling

if TYPE_CHECKING:
    from rlhflow.evaluation.compare import PolicyEvaluation

# The data behind the DVC plots (declared in rlhfops/stages.py), in metrics_dir.
REWARD_QUANTILES_CSV = "eval_reward_quantiles.csv"
CALIBRATION_CSV = "eval_calibration.csv"


def reward_quantiles(sft_rewards: list[float], ppo_rewards: list[float]) -> Any:
    """Sorted rewards of both models against their quantile: the two reward distributions as DVC line plots."""
    n = len(sft_rewards)
    return pd.DataFrame(
        {
            "quantile": [(i + 0.5) / n for i in range(n)],
            "sft_reward": sorted(sft_rewards),
            "ppo_reward": sorted(ppo_rewards),
        }
    )


def calibration_table(buckets) -> Any:
    return pd.DataFrame(
        {
            "confidence": [b.confidence for b in buckets],
            "accuracy": [b.accuracy for b in buckets],
            "perfect_calibration": [b.confidence for b in buckets],
            "pairs": [b.pairs for b in buckets],
        }
    )


def judge_instrument_lines(judge_metrics: dict[str, float]) -> list[str]:
    """The judge against the length rule on the held-out pairs, and a warning first when it does not beat it."""
    if "judge/accuracy" not in judge_metrics:
        return []
    m = judge_metrics
    diff, low, high = (m.get(f"judge/accuracy_minus_length_baseline{s}", math.nan) for s in ("", "_ci_low", "_ci_high"))
    lines = []
    if not low > 0:
        lines += [
            '**The judge does not beat the length rule** ("the shorter answer is the preferred one") on the held-out '
            "pairs: its verdicts below may track answer length as much as quality.",
            "",
        ]
    lines += [
        f"Judge accuracy on held-out pairs {m['judge/accuracy']:.3f} against the length rule's "
        f"{m.get('judge/length_baseline_accuracy', math.nan):.3f}: difference {diff:+.3f} ({low:+.3f} to {high:+.3f}).",
        "",
    ]
    return lines


class Figures:
    """The metrics as the report prints them: 4 decimals, "n/a" where missing, intervals as low - high."""

    def __init__(self, metrics: dict[str, float]):
        self.metrics = metrics

    def __call__(self, key: str) -> str:
        return f"{self.metrics[key]:.4f}" if key in self.metrics else "n/a"

    def interval(self, key: str) -> str:
        return f"{self(key + '_ci_low')} - {self(key + '_ci_high')}"


def report_markdown(
    metrics: dict[str, float],
    samples: dict[str, list],
    buckets=(),
    decisions=(),
    figures: list[str] = (),
    n_examples: int = 5,
    judge_metrics: dict[str, float] | None = None,
    settings: str = "",
) -> str:
    """report.md, section by section."""
    fmt = Figures(metrics)
    lines = ["# Evaluation: policy vs SFT model", ""]
    lines += judge_instrument_lines(judge_metrics or {})
    if "eval/judge_win_rate_vs_sft" in metrics:
        lines += _overview_lines(fmt, settings) + _answers_lines(fmt) + _win_rate_lines(fmt)
    lines += _registry_lines(decisions)
    lines += ["## Metrics", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v:.4f} |" for k, v in sorted(metrics.items())]
    lines += _drift_lines(fmt)
    if buckets:
        lines += _reward_model_lines(fmt, buckets)
    if figures:
        lines += ["## Plots", ""] + [f"![{f}](plots/{f}.png)" for f in figures] + [""]
    lines += _sample_lines(samples, n_examples)
    return "\n".join(lines)


def _kendall_clause(fmt: Figures) -> str:
    """Kendall's tau against the human ranking, where some prompt ranks more than two responses (else nothing)."""
    ranked = int(fmt.metrics.get("rm/ranked_prompts", 0))
    if not ranked:
        return ""
    tau = fmt("rm/kendall_tau")
    return f"; Kendall's tau against the human ranking {tau} over {ranked} prompts that rank more than two responses"


def _overview_lines(fmt: Figures, settings: str) -> list[str]:
    """How many prompts and answers, the half-width that many conversations give, and where choices are made."""
    m = fmt.metrics
    lines = [
        f"{int(m.get('eval/prompts', 0))} held-out prompts, one per test conversation "
        f"({int(m.get('eval/answers', 0))} answers per model); a win rate near 0.5 on this many "
        f"conversations has a 95% half-width of about +-{m.get('eval/expected_half_width', math.nan):.3f}. "
        f"Sampling: {settings}.",
        "",
    ]
    if "dev/prompts" in m:
        lines += [
            f"Choices (the champion rule, a sweep's best point) read the dev split instead: "
            f"{int(m['dev/prompts'])} other held-out conversations, half-width about "
            f"+-{m.get('dev/expected_half_width', math.nan):.3f}; there the judge win rate is "
            f"{fmt('dev/judge_win_rate_vs_sft')}, {fmt('dev/judge_win_rate_both_ended')} where both ended. "
            "Nothing is chosen on the test split, so the figures below are not selected on.",
            "",
        ]
    else:
        lines += [
            "The dev split was not answered up front (`evaluate.dev_figures` false): the champion rule answers it "
            "where it compares with a champion, and a sweep sets it. Nothing is chosen on the test split.",
            "",
        ]
    return lines


def _answers_lines(fmt: Figures) -> list[str]:
    lines = ["## Answers: ended, cut at the limit, degenerate", "", "| | SFT | policy |", "|---|---|---|"]
    lines += [
        f"| {label} | {fmt(f'eval/answers_{name}_sft')} | {fmt(f'eval/answers_{name}')} |"
        for name, label in [
            ("ended", "ended by itself (EOS or stop string)"),
            ("cut", "cut at the limit"),
            ("degenerate", "degenerate (repetition loop)"),
        ]
    ]
    return lines + [
        "",
        f"Both answers ended on {int(fmt.metrics.get('eval/both_ended_prompts', 0))} answer pairs: the win rate there "
        "compares finished answers only, so it does not reward merely stopping in time.",
        "",
    ]


def _win_rate_lines(fmt: Figures) -> list[str]:
    lines = [
        "## Win rate against the SFT model",
        "",
        "Win rates on hard verdicts (a win 1, a tie 0.5, a loss 0), each beside its length-controlled value fitted on "
        "the same verdicts.",
        "",
        "| judged by | win rate | 95% interval | both ended | 95% interval | length-controlled | 95% interval |",
        "|---|---|---|---|---|---|---|",
    ]
    judged_by = [
        ("", "proxy reward model (optimised by the policy)"),
        ("judge_", "judge (never optimised against)"),
    ]
    for source, label in judged_by:
        key = f"{source}win_rate"
        supported = fmt.metrics.get(f"eval/{key}_lc_supported", 1.0) >= 1
        lc = fmt(f"eval/{key}_lc") + ("" if supported else " (unsupported)")
        lines.append(
            f"| {label} | {fmt(f'eval/{key}_vs_sft')} | {fmt.interval(f'eval/{key}')} | "
            f"{fmt(f'eval/{key}_both_ended')} | {fmt.interval(f'eval/{key}_both_ended')} | {lc} | "
            f"{fmt.interval(f'eval/{key}_lc')} |"
        )
    lines += _soft_preference_lines(fmt, judged_by)
    lines += [
        "",
        f"Proxy minus judge: {fmt('eval/proxy_judge_gap')} ({fmt.interval('eval/proxy_judge_gap')}; a large positive "
        "gap is a sign of reward hacking: the policy pleases the model it was trained against more than an "
        "independent one). The length-controlled win rate is what a model of the judge's verdicts on the "
        "length difference predicts at equal length (AlpacaEval 2.0's estimator); \"unsupported\" means the answers' "
        "lengths do not cover equal length, so that figure is an extrapolation and says little.",
        "",
    ]
    if fmt.metrics.get("eval/judge_malformed"):
        lines += [f"The judge's reply was malformed {int(fmt.metrics['eval/judge_malformed'])} times (a tie).", ""]
    return lines


def _soft_preference_lines(fmt: Figures, judged_by: list[tuple[str, str]]) -> list[str]:
    """The soft scale, where a judge grades its preference (a reward model: the sigmoid of its score difference),
    in a table of its own: it is not a win rate, and its length-controlled value is not the hard one's."""
    graded = [(source, label) for source, label in judged_by if f"eval/{source}soft_preference" in fmt.metrics]
    if not graded:
        return []
    lines = [
        "",
        "Soft scale: the mean of the judge's probability that the policy's answer is better, and the same fitted at "
        "equal length. It reads nearer 0.5 than the win rate whenever scores differ little, whatever they rank.",
        "",
        "| judged by | mean soft preference | 95% interval | length-controlled | 95% interval |",
        "|---|---|---|---|---|",
    ]
    for source, label in graded:
        key = f"eval/{source}soft_preference"
        lines.append(
            f"| {label} | {fmt(key)} | {fmt.interval(key)} | {fmt(f'{key}_lc')} | {fmt.interval(f'{key}_lc')} |"
        )
    return lines


def _registry_lines(decisions) -> list[str]:
    if not decisions:
        return []
    lines = ["## Model registry", "", "| model | candidate | champion | decision | why |", "|---|---|---|---|---|"]
    lines += [
        f"| {d.model} | v{d.candidate} | {'v' + d.champion if d.champion else '-'} | "
        f"{'promoted' if d.promoted else 'kept'} | {d.reason} |"
        for d in decisions
    ]
    return lines + [""]


def _drift_lines(fmt: Figures) -> list[str]:
    lines = [
        "",
        "## Reward hacking and drift",
        "",
        "| | SFT | policy |",
        "|---|---|---|",
        f"| reward, proxy (optimised by the policy) | {fmt('eval/reward_mean_sft')} | {fmt('eval/reward_mean')} |",
        f"| reward, judge (never optimised) | {fmt('eval/judge_reward_mean_sft')} | {fmt('eval/judge_reward_mean')} |",
    ]
    for key, label in [
        ("response_length", "response length, words"),
        ("eos_fraction", "responses ended by EOS"),
        ("answer_tokens", "answer length, tokens"),
        ("distinct_1", "distinct-1"),
        ("distinct_2", "distinct-2"),
        ("repetition_rate", "repetition rate (seq-rep-4)"),
        ("perplexity", "perplexity of reference answers"),
    ]:
        lines.append(f"| {label} | {fmt(f'eval/{key}_sft')} | {fmt(f'eval/{key}')} |")
    return lines + [f"| KL to SFT, nats per response | 0 | {fmt('eval/kl')} |", ""]


def _reward_model_lines(fmt: Figures, buckets) -> list[str]:
    lines = [
        "## Reward model on held-out pairs",
        "",
        f"Accuracy {fmt('rm/accuracy')} ({fmt.interval('rm/accuracy')}); the length rule (the shorter answer is "
        f"chosen) on the same pairs {fmt('rm/length_baseline_accuracy')} "
        f"({fmt.interval('rm/length_baseline_accuracy')}), difference {fmt('rm/accuracy_minus_length_baseline')} "
        f"({fmt.interval('rm/accuracy_minus_length_baseline')}); length-controlled {fmt('rm/accuracy_lc')} "
        f"({fmt.interval('rm/accuracy_lc')}). On the soft scale (the mean Bradley-Terry probability of the chosen "
        f"answer) {fmt('rm/soft_accuracy')}, length-controlled {fmt('rm/soft_accuracy_lc')} "
        f"({fmt.interval('rm/soft_accuracy_lc')})."
        f" Expected calibration error {fmt('rm/ece')}{_kendall_clause(fmt)}.",
        "",
        "| confidence bucket | pairs | mean confidence | accuracy |",
        "|---|---|---|---|",
    ]
    lines += [f"| {b.low:.1f}-{b.high:.1f} | {b.pairs} | {b.confidence:.3f} | {b.accuracy:.3f} |" for b in buckets]
    return lines + [""]


def _sample_lines(samples: dict[str, list], n_examples: int) -> list[str]:
    lines = ["## Samples", ""]
    for i in range(min(n_examples, len(samples["prompt"]))):
        lines += [
            f"**Prompt:** {samples['prompt'][i]}",
            "",
            f"- SFT ({samples['sft_class'][i]}, reward {samples['sft_reward'][i]:+.2f}): {samples['sft_response'][i]}",
            f"- policy ({samples['ppo_class'][i]}, reward {samples['ppo_reward'][i]:+.2f}): "
            f"{samples['ppo_response'][i]}",
            "",
        ]
    return lines


def sampling_description(s: Sampling) -> str:
    return (
        f"temperature {s.temperature}, top-k {s.top_k or 'off'}, top-p {s.top_p}, repetition penalty "
        f"{s.repetition_penalty}, up to {s.max_new_tokens} new tokens, seed {s.seed}"
    )


def write_outputs(
    report_dir: Path,
    metrics_dir: Path,
    sampling: Sampling,
    result: PolicyEvaluation,
    decisions: list,
    judge_metrics: dict | None = None,
) -> None:
    """The plot data in `metrics_dir` (DVC plots) and, all at once, `report_dir`: samples, figures (the PPO
    history's too, when there is one) and report.md with the champion decisions and the `sampling` settings."""
    samples, buckets = result.samples, result.buckets
    history_csv = metrics_dir / "ppo_history.csv"
    history = pd.read_csv(history_csv) if history_csv.exists() else None
    write_text_atomic(
        metrics_dir / REWARD_QUANTILES_CSV,
        reward_quantiles(samples["sft_reward"], samples["ppo_reward"]).to_csv(index=False),
    )
    write_text_atomic(metrics_dir / CALIBRATION_CSV, calibration_table(buckets).to_csv(index=False))
    with atomic_dir(report_dir, setting="evaluate.report_dir") as tmp:
        write_json_atomic(tmp / "samples.json", samples)
        figures = {
            "reward_distributions": plots.reward_distributions(samples["sft_reward"], samples["ppo_reward"]),
            "rm_calibration": plots.calibration(buckets),
        }
        if history is not None and len(history):
            figures.update(plots.training_figures(history))
        (tmp / "plots").mkdir()
        for fig_name, fig in figures.items():
            fig.savefig(tmp / "plots" / f"{fig_name}.png", dpi=110)
            plots.close(fig)
        write_text_atomic(
            tmp / "report.md",
            report_markdown(
                result.metrics,
                samples,
                buckets,
                decisions,
                sorted(figures),
                judge_metrics=judge_metrics,
                settings=sampling_description(sampling),
            ),
        )
