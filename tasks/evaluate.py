"""Stage evaluate: on held-out prompts, sample from the SFT model and the PPO policy and score both with the
reward model; KL of the policy to the reference; perplexity of both on held-out reference responses;
reward-model accuracy on held-out pairs. Metrics go to the stage run, the parent run and metrics/evaluate.json."""

from __future__ import annotations

from rlhflow.config import Config
from tasks._common import StageContext, cli, stage_task

NAME = "evaluate"


def sample(model, tokenizer, prompt_messages, cfg: Config):
    """Responses for all prompts, with the same sampling seed for every model compared."""
    from rlhflow.policy import sample_responses

    e = cfg.evaluate
    return sample_responses(model, tokenizer, prompt_messages, batch_size=e.batch_size,
                            max_prompt_length=cfg.ppo.max_prompt_length, max_new_tokens=e.max_new_tokens,
                            temperature=e.temperature, stop_strings=cfg.ppo.stop_strings, seed=cfg.seed)


def run(cfg: Config, ctx: StageContext) -> dict[str, float]:
    import mlflow
    import torch

    from rlhflow.data.formats import read_jsonl
    from rlhflow.fsutil import atomic_dir, write_json_atomic, write_text_atomic
    from rlhflow.metrics import distinct_n, perplexity, response_kl, win_rate
    from rlhflow.models import load_causal_lm, load_tokenizer, pick_device
    from rlhflow.reward import RewardModel, evaluate_pairs

    e = cfg.evaluate
    device = pick_device(cfg.device)
    sft_dir, policy_dir = str(cfg.path(cfg.sft.out_dir)), str(cfg.path(cfg.ppo.out_dir))
    tokenizer = load_tokenizer(sft_dir)
    sft = load_causal_lm(sft_dir, pad_token_id=tokenizer.pad_token_id).to(device).eval()
    policy = load_causal_lm(policy_dir, pad_token_id=tokenizer.pad_token_id).to(device).eval()
    rm = RewardModel.load(cfg.path(cfg.reward_model.out_dir), batch_size=cfg.reward_model.eval_batch_size, device=device)

    test = read_jsonl(cfg.path(cfg.validate_.out_dir) / "test.jsonl")
    prompts_df = test.drop_duplicates("prompt").head(e.n_prompts)
    prompts = list(prompts_df["prompt_messages"])

    sft_out, policy_out = sample(sft, tokenizer, prompts, cfg), sample(policy, tokenizer, prompts, cfg)
    sft_texts = [t for o in sft_out for t in o.texts]
    policy_texts = [t for o in policy_out for t in o.texts]
    sft_scores, policy_scores = rm.score(prompts, sft_texts), rm.score(prompts, policy_texts)
    kl = torch.cat([response_kl(policy, sft, o.query_response, o.attention_mask, o.context_length,
                                o.response_mask, e.temperature).cpu() for o in policy_out])

    ref_rows = test.drop_duplicates("prompt").head(e.perplexity_rows)
    ppl_args = (list(ref_rows["prompt_messages"]), list(ref_rows["chosen"]))
    pairs = evaluate_pairs(rm, test.to_dict("records"))
    metrics = {
        "eval/reward_mean": float(policy_scores.mean()),
        "eval/reward_mean_sft": float(sft_scores.mean()),
        "eval/win_rate_vs_sft": win_rate(policy_scores, sft_scores),
        "eval/kl": float(kl.mean()),
        "eval/perplexity": perplexity(policy, tokenizer, *ppl_args, batch_size=e.batch_size),
        "eval/perplexity_sft": perplexity(sft, tokenizer, *ppl_args, batch_size=e.batch_size),
        "eval/response_length": sum(len(t.split()) for t in policy_texts) / len(policy_texts),
        "eval/response_length_sft": sum(len(t.split()) for t in sft_texts) / len(sft_texts),
        "eval/distinct_2": distinct_n(policy_texts, 2),
        "eval/distinct_2_sft": distinct_n(sft_texts, 2),
        "rm/accuracy": pairs["accuracy"],
    }
    ctx.log_metrics(metrics, on_parent=True)

    samples = {"prompt": list(prompts_df["prompt"]), "sft_response": sft_texts, "ppo_response": policy_texts,
               "sft_reward": [float(x) for x in sft_scores], "ppo_reward": [float(x) for x in policy_scores],
               "kl": [float(x) for x in kl]}
    mlflow.log_table(samples, artifact_file="samples.json")
    with atomic_dir(cfg.path(e.report_dir)) as tmp:
        write_json_atomic(tmp / "samples.json", samples)
        write_text_atomic(tmp / "report.md", report_markdown(metrics, samples))
    mlflow.log_artifacts(str(cfg.path(e.report_dir)), artifact_path="evaluation")
    return metrics


def report_markdown(metrics: dict[str, float], samples: dict[str, list], n_examples: int = 5) -> str:
    lines = ["# Evaluation: PPO policy vs SFT model", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v:.4f} |" for k, v in sorted(metrics.items())]
    lines += ["", "## Samples", ""]
    for i in range(min(n_examples, len(samples["prompt"]))):
        lines += [f"**Prompt:** {samples['prompt'][i]}", "",
                  f"- SFT (reward {samples['sft_reward'][i]:+.2f}): {samples['sft_response'][i]}",
                  f"- PPO (reward {samples['ppo_reward'][i]:+.2f}): {samples['ppo_response'][i]}", ""]
    return "\n".join(lines)


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
