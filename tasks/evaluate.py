"""Stage evaluate: on held-out prompts, sample from the SFT model and the PPO policy and score both with the
proxy reward model (the one PPO optimised) and with the judge (trained on other prompts, never optimised
against); win rates with 95% bootstrap intervals, and the proxy-judge gap as a reward-hacking signal; KL of the
policy to the reference; perplexity of both on held-out reference responses; what
reveals reward hacking and drift (length, distinct-n, repetition); reward-model accuracy, calibration and
ranking agreement on held-out pairs. Then the champion decision for the registered reward model and policy (the
policy by the judge's win rate).

Metrics go to the stage run, the parent run and metrics/evaluate.json; plots and the samples table to the stage
run; the report (reports/evaluate/report.md) says which version is champion and why."""

from __future__ import annotations

# Heavy imports (torch, transformers, mlflow, the library's model code) are deferred into the stage body, so
# that importing the module (the flow does, to get its task; so does `--help`) stays fast.
import math
import tempfile
from typing import Any

from rlhflow.config import Config
from tasks._common import StageContext, cli, stage_task
from tasks.ppo import REGISTERED_NAME as POLICY_NAME
from tasks.reward_model import REGISTERED_NAME as REWARD_MODEL_NAME

NAME = "evaluate"
# The data behind the DVC plots (declared in rlhflow/stages.py), in metrics_dir.
REWARD_QUANTILES_CSV = "eval_reward_quantiles.csv"
CALIBRATION_CSV = "eval_calibration.csv"


def sample(model, tokenizer, prompt_messages, cfg: Config):
    """Responses for all prompts, with the same sampling seed for every model compared; sampled as PPO samples
    (top-k / top-p, stop strings) at the evaluation temperature."""
    from rlhflow.policy import sample_responses

    e = cfg.evaluate
    return sample_responses(
        model,
        tokenizer,
        prompt_messages,
        batch_size=e.batch_size,
        max_prompt_length=cfg.ppo.max_prompt_length,
        max_new_tokens=e.max_new_tokens,
        temperature=cfg.eval_temperature,
        top_k=cfg.ppo.top_k,
        top_p=cfg.ppo.top_p,
        stop_strings=cfg.ppo.stop_strings,
        seed=cfg.seed,
    )


def texts_of(outputs) -> list[str]:
    return [t for o in outputs for t in o.texts]


def eos_fraction(outputs) -> float:
    """Share of responses that ended by themselves (EOS or a stop string) rather than at max_new_tokens."""
    ended = [bool(e) for o in outputs for e in o.ended]
    return sum(ended) / len(ended) if ended else math.nan


def text_metrics(texts: list[str], suffix: str = "") -> dict[str, float]:
    """Drift and reward-hacking signals of a set of responses (suffix "_sft" for the SFT model's)."""
    from rlhflow.metrics import distinct_n, mean_length, repetition_rate

    return {
        f"eval/response_length{suffix}": mean_length(texts),
        f"eval/distinct_1{suffix}": distinct_n(texts, 1),
        f"eval/distinct_2{suffix}": distinct_n(texts, 2),
        f"eval/repetition_rate{suffix}": repetition_rate(texts),
    }


def reward_model_metrics(pairs, rows: list[dict]) -> tuple[dict[str, float], list]:
    """The proxy on the held-out pairs (`rlhflow.reward_model.evaluate_pairs` of `rows`) as `rm/` metrics:
    accuracy, calibration, and agreement of its scores with the human ranking of each prompt's responses; and
    the confidence buckets (rlhflow.metrics.ConfidenceBucket) behind the calibration."""
    from rlhflow.metrics import confidence_buckets, expected_calibration_error, ranking_agreement

    buckets = confidence_buckets(pairs.chosen - pairs.rejected)  # raw scores: the Bradley-Terry probability
    scores = {}
    for row, c, r in zip(rows, pairs.chosen.tolist(), pairs.rejected.tolist()):
        scores.setdefault((row["prompt"], row["chosen"]), c)
        scores.setdefault((row["prompt"], row["rejected"]), r)
    tau, ranked_prompts = ranking_agreement(rows, scores)
    metrics = {
        "rm/accuracy": pairs.metrics["accuracy"],
        "rm/ece": expected_calibration_error(buckets),
        "rm/kendall_tau": tau,
        "rm/ranked_prompts": float(ranked_prompts),
    }
    metrics.update({f"rm/accuracy_conf_{b.label}": b.accuracy for b in buckets})
    return metrics, buckets


def run(cfg: Config, ctx: StageContext) -> dict[str, float]:
    import mlflow
    import pandas as pd
    import torch

    from rlhflow import plots, tracking
    from rlhflow.data.formats import read_jsonl
    from rlhflow.fsutil import atomic_dir, write_json_atomic, write_text_atomic
    from rlhflow.metrics import perplexity, response_kl, win_rate, win_rate_interval
    from rlhflow.models import load_causal_lm, load_tokenizer, pick_device
    from rlhflow.reward_model import RewardModel, evaluate_pairs

    e = cfg.evaluate
    device = pick_device(cfg.device)
    sft_dir, policy_dir = str(cfg.path(cfg.sft.out_dir)), str(cfg.path(cfg.ppo.out_dir))
    tokenizer = load_tokenizer(sft_dir)
    sft = load_causal_lm(sft_dir, pad_token_id=tokenizer.pad_token_id).to(device).eval()
    policy = load_causal_lm(policy_dir, pad_token_id=tokenizer.pad_token_id).to(device).eval()
    rm = RewardModel.load(
        cfg.path(cfg.reward_model.out_dir), batch_size=cfg.reward_model.eval_batch_size, device=device
    )
    judge = RewardModel.load(cfg.path(cfg.judge.out_dir), batch_size=cfg.judge.eval_batch_size, device=device)

    test = read_jsonl(cfg.path(cfg.validate_.out_dir) / "test.jsonl")
    prompts_df = test.drop_duplicates("prompt").head(e.n_prompts)
    prompts = list(prompts_df["prompt_messages"])

    sft_out, policy_out = sample(sft, tokenizer, prompts, cfg), sample(policy, tokenizer, prompts, cfg)
    sft_texts, policy_texts = texts_of(sft_out), texts_of(policy_out)
    sft_scores, policy_scores = rm.score(prompts, sft_texts), rm.score(prompts, policy_texts)
    sft_judged, policy_judged = judge.score(prompts, sft_texts), judge.score(prompts, policy_texts)
    win_ci = win_rate_interval(policy_scores, sft_scores, seed=cfg.seed)
    judge_win_ci = win_rate_interval(policy_judged, sft_judged, seed=cfg.seed)
    kl = torch.cat(
        [
            response_kl(
                policy, sft, o.query_response, o.attention_mask, o.context_length, o.response_mask, cfg.eval_temperature
            ).cpu()
            for o in policy_out
        ]
    )  # as sampled

    ref_rows = test.drop_duplicates("prompt").head(e.perplexity_rows)
    ppl_args = (list(ref_rows["prompt_messages"]), list(ref_rows["chosen"]))
    pair_rows = test.to_dict("records")
    rm_metrics, buckets = reward_model_metrics(evaluate_pairs(rm, pair_rows), pair_rows)
    metrics = {
        "eval/reward_mean": float(policy_scores.mean()),
        "eval/reward_mean_sft": float(sft_scores.mean()),
        "eval/win_rate_vs_sft": win_rate(policy_scores, sft_scores),
        "eval/win_rate_ci_low": win_ci[0],
        "eval/win_rate_ci_high": win_ci[1],
        "eval/judge_reward_mean": float(policy_judged.mean()),
        "eval/judge_reward_mean_sft": float(sft_judged.mean()),
        "eval/judge_win_rate_vs_sft": win_rate(policy_judged, sft_judged),
        "eval/judge_win_rate_ci_low": judge_win_ci[0],
        "eval/judge_win_rate_ci_high": judge_win_ci[1],
        "eval/kl": float(kl.mean()),
        "eval/perplexity": perplexity(policy, tokenizer, *ppl_args, batch_size=e.batch_size),
        "eval/perplexity_sft": perplexity(sft, tokenizer, *ppl_args, batch_size=e.batch_size),
        "eval/eos_fraction": eos_fraction(policy_out),
        "eval/eos_fraction_sft": eos_fraction(sft_out),
        **text_metrics(policy_texts),
        **text_metrics(sft_texts, "_sft"),
        **rm_metrics,
    }
    # reward hacking shows as a proxy win rate above the judge's
    metrics["eval/proxy_judge_gap"] = metrics["eval/win_rate_vs_sft"] - metrics["eval/judge_win_rate_vs_sft"]
    # NaN (e.g. Kendall's tau without ranked prompts) is left out: "no value", in MLflow and DVC alike
    metrics = {k: v for k, v in metrics.items() if not math.isnan(v)}
    ctx.log_metrics(metrics, on_parent=True)

    samples = {
        "prompt": list(prompts_df["prompt"]),
        "sft_response": sft_texts,
        "ppo_response": policy_texts,
        "sft_reward": [float(x) for x in sft_scores],
        "ppo_reward": [float(x) for x in policy_scores],
        "sft_judge": [float(x) for x in sft_judged],
        "ppo_judge": [float(x) for x in policy_judged],
        "kl": [float(x) for x in kl],
    }
    mlflow.log_table(samples, artifact_file="samples.json")

    def champion_policy_win_rate(version) -> float:
        """The champion policy on this run's prompts, judged by this run's judge against the same SFT samples."""
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = tracking.registered_model_dir(mlflow.MlflowClient(), POLICY_NAME, version.version, tmp)
            champion = load_causal_lm(str(model_dir), pad_token_id=tokenizer.pad_token_id).to(device).eval()
            return win_rate(judge.score(prompts, texts_of(sample(champion, tokenizer, prompts, cfg))), sft_judged)

    def champion_rm_accuracy(version) -> float:
        """The champion reward model on this run's held-out pairs."""
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = tracking.registered_model_dir(mlflow.MlflowClient(), REWARD_MODEL_NAME, version.version, tmp)
            champion = RewardModel.load(model_dir, batch_size=cfg.reward_model.eval_batch_size, device=device)
            return evaluate_pairs(champion, pair_rows).metrics["accuracy"]

    decisions = []
    if cfg.tracking.log_models and cfg.tracking.register_models:
        client = mlflow.MlflowClient()
        challenges = [
            (REWARD_MODEL_NAME, cfg.reward_model.out_dir, "rm/accuracy", champion_rm_accuracy),
            (POLICY_NAME, cfg.ppo.out_dir, "eval/judge_win_rate_vs_sft", champion_policy_win_rate),
        ]
        for name, out_dir, metric, champion_value in challenges:
            version = tracking.version_of_model_dir(client, name, cfg.path(out_dir))
            if version is not None:
                decisions.append(
                    tracking.challenge_champion(
                        client, name, str(version.version), metric, metrics[metric], champion_value
                    )
                )

    history_csv = cfg.path(cfg.metrics_dir) / "ppo_history.csv"
    history = pd.read_csv(history_csv) if history_csv.exists() else None
    metrics_dir = cfg.path(cfg.metrics_dir)
    write_text_atomic(
        metrics_dir / REWARD_QUANTILES_CSV,
        reward_quantiles(samples["sft_reward"], samples["ppo_reward"]).to_csv(index=False),
    )
    write_text_atomic(metrics_dir / CALIBRATION_CSV, calibration_table(buckets).to_csv(index=False))
    with atomic_dir(cfg.path(e.report_dir)) as tmp:
        write_json_atomic(tmp / "samples.json", samples)
        figures = {
            "reward_distributions": plots.reward_distributions(samples["sft_reward"], samples["ppo_reward"]),
            "rm_calibration": plots.calibration(buckets),
        }
        if history is not None and len(history):
            figures.update(ppo_curves=plots.ppo_curves(history), reward_vs_kl=plots.reward_vs_kl(history))
        (tmp / "plots").mkdir()
        for fig_name, fig in figures.items():
            fig.savefig(tmp / "plots" / f"{fig_name}.png", dpi=110)
            plots.close(fig)
        write_text_atomic(tmp / "report.md", report_markdown(metrics, samples, buckets, decisions, sorted(figures)))
    mlflow.log_artifacts(str(cfg.path(e.report_dir)), artifact_path="evaluation")

    # Last, once everything else succeeded: a failed evaluation moves no alias.
    client = mlflow.MlflowClient()
    for decision in decisions:
        tracking.apply_champion_decision(client, decision, run_id=ctx.run_id)
        mlflow.set_tag(f"champion/{decision.model}", f"v{decision.champion}")
    return metrics


def reward_quantiles(sft_rewards: list[float], ppo_rewards: list[float]) -> Any:
    """Sorted rewards of both models against their quantile: the two reward distributions as DVC line plots."""
    import pandas as pd

    n = len(sft_rewards)
    return pd.DataFrame(
        {
            "quantile": [(i + 0.5) / n for i in range(n)],
            "sft_reward": sorted(sft_rewards),
            "ppo_reward": sorted(ppo_rewards),
        }
    )


def calibration_table(buckets) -> Any:
    import pandas as pd

    return pd.DataFrame(
        {
            "confidence": [b.confidence for b in buckets],
            "accuracy": [b.accuracy for b in buckets],
            "perfect_calibration": [b.confidence for b in buckets],
            "pairs": [b.pairs for b in buckets],
        }
    )


def report_markdown(
    metrics: dict[str, float],
    samples: dict[str, list],
    buckets=(),
    decisions=(),
    figures: list[str] = (),
    n_examples: int = 5,
) -> str:
    def fmt(key: str) -> str:
        return f"{metrics[key]:.4f}" if key in metrics else "n/a"

    lines = ["# Evaluation: PPO policy vs SFT model", ""]
    if "eval/judge_win_rate_vs_sft" in metrics:
        lines += [
            "## Win rate against the SFT model",
            "",
            "| judged by | win rate | 95% bootstrap interval |",
            "|---|---|---|",
            f"| proxy reward model (optimised by PPO) | {fmt('eval/win_rate_vs_sft')} | "
            f"{fmt('eval/win_rate_ci_low')} - {fmt('eval/win_rate_ci_high')} |",
            f"| judge reward model (never optimised) | {fmt('eval/judge_win_rate_vs_sft')} | "
            f"{fmt('eval/judge_win_rate_ci_low')} - {fmt('eval/judge_win_rate_ci_high')} |",
            "",
            f"Proxy minus judge: {fmt('eval/proxy_judge_gap')} (a large positive gap is a sign of reward "
            "hacking: the policy pleases the model it was trained against more than an independent one).",
            "",
        ]
    if decisions:
        lines += ["## Model registry", "", "| model | candidate | champion | decision | why |", "|---|---|---|---|---|"]
        lines += [
            f"| {d.model} | v{d.candidate} | v{d.champion} | {'promoted' if d.promoted else 'kept'} | {d.reason} |"
            for d in decisions
        ]
        lines += [""]
    lines += ["## Metrics", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v:.4f} |" for k, v in sorted(metrics.items())]
    lines += [
        "",
        "## Reward hacking and drift",
        "",
        "| | SFT | PPO |",
        "|---|---|---|",
        f"| reward, proxy (optimised by PPO) | {fmt('eval/reward_mean_sft')} | {fmt('eval/reward_mean')} |",
        f"| reward, judge (never optimised) | {fmt('eval/judge_reward_mean_sft')} | {fmt('eval/judge_reward_mean')} |",
    ]
    for key, label in [
        ("response_length", "response length, words"),
        ("eos_fraction", "responses ended by EOS"),
        ("distinct_1", "distinct-1"),
        ("distinct_2", "distinct-2"),
        ("repetition_rate", "repetition rate (seq-rep-4)"),
        ("perplexity", "perplexity of reference answers"),
    ]:
        lines.append(f"| {label} | {fmt(f'eval/{key}_sft')} | {fmt(f'eval/{key}')} |")
    lines += [f"| KL to SFT, nats per response | 0 | {fmt('eval/kl')} |", ""]
    if buckets:
        lines += [
            "## Reward model on held-out pairs",
            "",
            f"Accuracy {fmt('rm/accuracy')}, expected calibration error {fmt('rm/ece')}; Kendall's tau against "
            f"the human ranking {fmt('rm/kendall_tau')} over {int(metrics.get('rm/ranked_prompts', 0))} prompts "
            "that rank more than two responses.",
            "",
            "| confidence bucket | pairs | mean confidence | accuracy |",
            "|---|---|---|---|",
        ]
        lines += [f"| {b.low:.1f}-{b.high:.1f} | {b.pairs} | {b.confidence:.3f} | {b.accuracy:.3f} |" for b in buckets]
        lines += [""]
    if figures:
        lines += ["## Plots", ""] + [f"![{f}](plots/{f}.png)" for f in figures] + [""]
    lines += ["## Samples", ""]
    for i in range(min(n_examples, len(samples["prompt"]))):
        lines += [
            f"**Prompt:** {samples['prompt'][i]}",
            "",
            f"- SFT (reward {samples['sft_reward'][i]:+.2f}): {samples['sft_response'][i]}",
            f"- PPO (reward {samples['ppo_reward'][i]:+.2f}): {samples['ppo_response'][i]}",
            "",
        ]
    return "\n".join(lines)


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
