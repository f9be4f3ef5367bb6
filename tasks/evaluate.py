"""Stage evaluate: on one held-out prompt per test and dev conversation, sample the policy and compare its answers with
the SFT model's (the sft_answers stage), scored by the proxy reward model and by the judge (never optimised
against): ended / cut / degenerate shares, win rates (overall, both ended, length-controlled) with intervals over
conversations, the proxy-judge gap, KL to the reference, perplexity, drift, and the reward models on held-out pairs
beside the length rule. Every figure on the test split (eval/...); what choices read, on the dev split (dev/...).
Then the champion decisions for the registered reward model and policy (rlhflow/evaluation/champion.py).

Metrics go to the stage run, the parent run and metrics/evaluate.json; plots and the samples table to the stage
run; reports/evaluate/report.md says which version is champion and why. Definitions: docs/evaluation.md.
"""

from __future__ import annotations

import json
import tempfile

import mlflow

from rlhflow.config.params import Config
from rlhflow.data.readers import read_jsonl
from rlhflow.evaluation import report
from rlhflow.evaluation.compare import EvaluatedModels, PolicyEvaluator
from rlhflow.evaluation.held_out import REFERENCE_FILE, HeldOutData, HeldOutPrompts, load_reference
from rlhflow.evaluation.metrics import saved_held_out_perplexity
from rlhflow.evaluation.pairs import saved_pair_scores
from rlhflow.evaluation.settings import EvaluationSettings
from rlhflow.models.loading import pick_device, resolve_precision
from rlhfops import promotion, registry
from rlhfops.hashing import dir_md5, file_md5
from rlhfops.stage_runner import StageContext, cli, stage_task
from tasks.evaluation_setup import (
    evaluation_settings,
    held_out_split_files,
    load_evaluation_judge,
    load_language_model,
    load_proxy,
    sft_answers_key,
)

NAME = "evaluate"


def load_evaluated_models(cfg: Config) -> EvaluatedModels:
    """The SFT model, the policy, the proxy and the judge, loaded once on the configured device."""
    device = pick_device(cfg.device)
    tokenizer, sft = load_language_model(cfg.path(cfg.sft.out_dir), device)
    _, policy = load_language_model(cfg.path(cfg.ppo.out_dir), device)  # the same tokenizer as SFT's
    return EvaluatedModels(
        device=device,
        dtype=resolve_precision(cfg.evaluate.precision, device),
        tokenizer=tokenizer,
        sft=sft,
        policy=policy,
        rm=load_proxy(cfg.path(cfg.reward_model.out_dir), cfg, device),
        judge=load_evaluation_judge(cfg, device),
    )


def read_held_out_data(cfg: Config, settings: EvaluationSettings) -> HeldOutData:
    """The held-out prompts with the SFT model's answers to them, the test and dev pairs, and what the sft and
    reward_model stages saved about the test pairs (perplexity, pair scores)."""
    files = held_out_split_files(cfg)
    held_out = HeldOutPrompts.load(files, settings.n_prompts, settings.samples_per_prompt)
    sft_dir, rm_dir = cfg.path(cfg.sft.out_dir), cfg.path(cfg.reward_model.out_dir)
    reference_file = cfg.path(cfg.evaluate.reference_dir) / REFERENCE_FILE
    reference = load_reference(reference_file, sft_answers_key(settings, held_out, files, sft_dir))
    test_file = files["test"]
    return HeldOutData(
        prompts=held_out,
        reference=reference,
        test_rows=read_jsonl(test_file),
        dev_rows=read_jsonl(files["dev"]).to_dict("records") if "dev" in files else None,
        sft_perplexity=saved_held_out_perplexity(str(sft_dir), rows=settings.perplexity_rows, data_file=test_file),
        test_pair_scores=saved_pair_scores(rm_dir, data_file=test_file),
    )


def evaluation_basis(cfg: Config) -> dict[str, str]:
    """What a registered model's figures were measured on: the split files and the judge
    (rlhflow/evaluation/champion.py)."""
    validated = cfg.path(cfg.validate_.out_dir)
    basis = {
        f"{split}_split_md5": file_md5(path) if path.exists() else "none"
        for split in ("train", "dev", "test")
        for path in [validated / f"{split}.jsonl"]
    }
    basis["judge_md5"] = dir_md5(cfg.path(cfg.judge.out_dir))
    return basis


def registered_head_to_head(client, name: str, result, compare):
    """`compare(model_dir, challenge)` against the registered version's model dir, on the dev split: the head to
    head that `promotion.challenge_champion` calls; None without a dev split (nothing is chosen on the test split)."""

    def head_to_head(version, challenge: int):
        if result.dev is None:
            return None
        with tempfile.TemporaryDirectory() as tmp:
            return compare(str(registry.registered_model_dir(client, name, version.version, tmp)), challenge)

    return head_to_head


def champion_decisions(cfg: Config, client, evaluator: PolicyEvaluator, result) -> list:
    """The champion rule's decision for the registered reward model and policy this run trained, each against the
    version its alias points to (rlhflow/evaluation/champion.py); applied only once the stage succeeded."""
    device = evaluator.models.device

    def policy_against(model_dir: str, challenge: int):
        tokenizer, other = load_language_model(model_dir, device)
        return evaluator.policy_against(result, other, tokenizer, challenge)

    def reward_model_against(model_dir: str, challenge: int):
        return evaluator.reward_model_against(result, load_proxy(model_dir, cfg, device), challenge)

    basis = evaluation_basis(cfg)
    challenges = [  # the reward model's figures do not depend on the judge
        (registry.REWARD_MODEL, cfg.reward_model.out_dir, reward_model_against, ("train", "dev", "test")),
        (registry.POLICY, cfg.ppo.out_dir, policy_against, ("train", "dev", "test", "judge")),
    ]
    decisions = []
    for name, out_dir, compare, basis_of in challenges:
        version = registry.version_of_model_dir(client, name, cfg.path(out_dir))
        if version is not None:
            own_basis = {k: v for k, v in basis.items() if k.startswith(basis_of)}
            head_to_head = registered_head_to_head(client, name, result, compare)
            decisions.append(
                promotion.challenge_champion(
                    client, name, str(version.version), own_basis, head_to_head, cfg.evaluate.promote
                )
            )
    return decisions


def run(cfg: Config, ctx: StageContext) -> dict[str, float]:
    settings = evaluation_settings(cfg)
    evaluator = PolicyEvaluator(settings, load_evaluated_models(cfg), read_held_out_data(cfg, settings))
    result = evaluator.evaluate()
    ctx.log_metrics(result.metrics, on_parent=True)
    mlflow.set_tag("algorithm", cfg.align.algorithm)  # what made the policy (align.algorithm, one of its params)
    mlflow.log_table(result.samples, artifact_file="samples.json")

    client = mlflow.MlflowClient()
    registering = cfg.tracking.log_models and cfg.tracking.register_models
    decisions = champion_decisions(cfg, client, evaluator, result) if registering else []

    # the judge stage's figures (the judge against the length rule), for the report
    metrics_dir, report_dir = cfg.path(cfg.metrics_dir), cfg.path(cfg.evaluate.report_dir)
    judge_file = metrics_dir / "judge.json"
    judge_metrics = json.loads(judge_file.read_text()) if judge_file.exists() else {}
    report.write_outputs(report_dir, metrics_dir, settings.sampling, result, decisions, judge_metrics)
    mlflow.log_artifacts(str(report_dir), artifact_path="evaluation")

    # Last, once everything else succeeded: a failed evaluation moves no alias.
    for decision in decisions:
        promotion.apply_champion_decision(client, decision, run_id=ctx.run_id)
        mlflow.set_tag(f"champion/{decision.model}", f"v{decision.champion}" if decision.champion else "none")
    return result.metrics


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
