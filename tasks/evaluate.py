"""Stage evaluate: on held-out prompts, sample from the SFT model and the policy and score both with the proxy
reward model (the one the policy optimised) and with the judge (trained on other conversations, never optimised
against): win rates and length-controlled win rates with 95% intervals, the proxy-judge gap; KL of the policy to
the reference; perplexity of both on held-out reference responses; drift (length, EOS, distinct-n, repetition);
reward-model accuracy beside the length rule, calibration and ranking agreement on held-out pairs (what each is:
rlhflow/evaluation.py). Then the champion decisions for the registered reward model and policy
(rlhflow/champion.py: only against a champion of the same splits and judge, head to head).

Metrics go to the stage run, the parent run and metrics/evaluate.json; plots and the samples table to the stage
run; the report (reports/evaluate/report.md) says which version is champion and why."""

from __future__ import annotations

# Heavy imports (torch, transformers, mlflow, the library's model code) are deferred into the stage body, so
# that importing the module (the flow does, to get its task; so does `--help`) stays fast.
import math
import tempfile

from rlhflow import registered_models
from rlhflow.config import Config
from tasks._common import StageContext, cli, stage_task

NAME = "evaluate"
# The data behind the DVC plots (declared in rlhflow/stages.py), in metrics_dir.
REWARD_QUANTILES_CSV = "eval_reward_quantiles.csv"
CALIBRATION_CSV = "eval_calibration.csv"


def evaluation_basis(cfg: Config) -> dict[str, str]:
    """What a registered model's figures were measured on: the split files and the judge (rlhflow/champion.py)."""
    from rlhflow.hashing import dir_md5, file_md5

    validated = cfg.path(cfg.validate_.out_dir)
    basis = {f"{split}_split_md5": file_md5(validated / f"{split}.jsonl") for split in ("train", "test")}
    basis["judge_md5"] = dir_md5(cfg.path(cfg.judge.out_dir))
    return basis


def run(cfg: Config, ctx: StageContext) -> dict[str, float]:
    import mlflow
    import pandas as pd
    import torch

    from rlhflow import evaluation as ev
    from rlhflow import plots, tracking
    from rlhflow.data.readers import read_jsonl
    from rlhflow.fsutil import atomic_dir, write_json_atomic, write_text_atomic
    from rlhflow.metrics import perplexity, response_kl
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

    sft_out, policy_out = ev.sample(sft, tokenizer, prompts, cfg), ev.sample(policy, tokenizer, prompts, cfg)
    sft_texts, policy_texts = ev.texts_of(sft_out), ev.texts_of(policy_out)
    sft_scores, policy_scores = rm.score(prompts, sft_texts), rm.score(prompts, policy_texts)
    sft_judged, policy_judged = judge.score(prompts, sft_texts), judge.score(prompts, policy_texts)
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
    pairs = evaluate_pairs(rm, pair_rows)
    rm_metrics, buckets = ev.reward_model_metrics(pairs, pair_rows)
    metrics = {
        **ev.comparison_metrics(policy_scores, sft_scores, policy_judged, sft_judged, policy_texts, sft_texts),
        "eval/kl": float(kl.mean()),
        "eval/perplexity": perplexity(policy, tokenizer, *ppl_args, batch_size=e.batch_size),
        "eval/perplexity_sft": perplexity(sft, tokenizer, *ppl_args, batch_size=e.batch_size),
        "eval/eos_fraction": ev.eos_fraction(policy_out),
        "eval/eos_fraction_sft": ev.eos_fraction(sft_out),
        **ev.text_metrics(policy_texts),
        **ev.text_metrics(sft_texts, "_sft"),
        **rm_metrics,
    }
    # NaN (e.g. Kendall's tau without ranked prompts) is left out: "no value", in MLflow and DVC alike
    metrics = {k: v for k, v in metrics.items() if not math.isnan(v)}
    ctx.log_metrics(metrics, on_parent=True)
    mlflow.set_tag("algorithm", cfg.align.algorithm)  # what made the policy (align.algorithm, one of its params)

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

    def champion_policy(version):
        """Head to head on this run's prompts, judged by this run's judge; the champion samples with its own
        tokenizer (its chat template and special tokens), as it would be served."""
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = str(tracking.registered_model_dir(client, registered_models.POLICY, version.version, tmp))
            champion_tokenizer = load_tokenizer(model_dir)
            champion = load_causal_lm(model_dir, pad_token_id=champion_tokenizer.pad_token_id).to(device).eval()
            champion_texts = ev.texts_of(ev.sample(champion, champion_tokenizer, prompts, cfg))
        return ev.policy_head_to_head(policy_judged, judge.score(prompts, champion_texts))

    def champion_reward_model(version):
        """Head to head on this run's held-out pairs."""
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = tracking.registered_model_dir(client, registered_models.REWARD_MODEL, version.version, tmp)
            champion = RewardModel.load(model_dir, batch_size=cfg.reward_model.eval_batch_size, device=device)
            return ev.reward_model_head_to_head(
                pairs.correct.tolist(), evaluate_pairs(champion, pair_rows).correct.tolist()
            )

    decisions = []
    if cfg.tracking.log_models and cfg.tracking.register_models:
        client = mlflow.MlflowClient()
        basis = evaluation_basis(cfg)
        challenges = [  # the reward model's figures do not depend on the judge
            (registered_models.REWARD_MODEL, cfg.reward_model.out_dir, champion_reward_model, ("train", "test")),
            (registered_models.POLICY, cfg.ppo.out_dir, champion_policy, ("train", "test", "judge")),
        ]
        for name, out_dir, head_to_head, basis_of in challenges:
            version = tracking.version_of_model_dir(client, name, cfg.path(out_dir))
            if version is not None:
                own_basis = {k: v for k, v in basis.items() if k.startswith(basis_of)}
                decisions.append(
                    tracking.challenge_champion(client, name, str(version.version), own_basis, head_to_head, e.promote)
                )

    history_csv = cfg.path(cfg.metrics_dir) / "ppo_history.csv"
    history = pd.read_csv(history_csv) if history_csv.exists() else None
    metrics_dir = cfg.path(cfg.metrics_dir)
    write_text_atomic(
        metrics_dir / REWARD_QUANTILES_CSV,
        ev.reward_quantiles(samples["sft_reward"], samples["ppo_reward"]).to_csv(index=False),
    )
    write_text_atomic(metrics_dir / CALIBRATION_CSV, ev.calibration_table(buckets).to_csv(index=False))
    with atomic_dir(cfg.path(e.report_dir)) as tmp:
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
        write_text_atomic(tmp / "report.md", ev.report_markdown(metrics, samples, buckets, decisions, sorted(figures)))
    mlflow.log_artifacts(str(cfg.path(e.report_dir)), artifact_path="evaluation")

    # Last, once everything else succeeded: a failed evaluation moves no alias.
    client = mlflow.MlflowClient()
    for decision in decisions:
        tracking.apply_champion_decision(client, decision, run_id=ctx.run_id)
        mlflow.set_tag(f"champion/{decision.model}", f"v{decision.champion}" if decision.champion else "none")
    return metrics


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
