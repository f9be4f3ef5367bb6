"""Stage evaluate: on one held-out prompt per test conversation, sample the policy and compare its answers with the
SFT model's (the sft_answers stage), scored by the proxy reward model and by the judge (never optimised against):
ended / cut / degenerate shares, win rates (overall, both ended, length-controlled) with intervals over
conversations, the proxy-judge gap, KL to the reference, perplexity, drift, and the reward models on held-out pairs
beside the length rule. Every figure on the test split (eval/...). The dev split is answered where a choice reads
it: up front with evaluate.dev_figures (dev/..., what a sweep chooses by), else by the champion rule's head to head
alone. Then the champion decisions for the registered reward model and policy (rlhflow/evaluation/champion.py).

Metrics go to the stage run, the parent run and metrics/evaluate.json; plots and the samples table to the stage
run; reports/evaluate/report.md says which version is champion and why. Definitions: docs/evaluation.md.
"""

from __future__ import annotations

import json
import tempfile
from typing import TYPE_CHECKING

from rlhflow.config.params import Config
from rlhfops.stage_runner import StageContext, cli, stage_task
from tasks.evaluation_setup import (
    EvaluationInputs,
    evaluation_basis,
    evaluation_inputs,
    load_evaluation_judge,
    sft_answers_key,
)

# A light door: torch, transformers, mlflow, pandas and scipy (the models, the evaluation, the registry) are imported
# inside the functions that use them, so the stage's --help and its checks answer before any of them loads.
if TYPE_CHECKING:
    from rlhflow.evaluation.compare import EvaluatedModels, PolicyEvaluator
    from rlhflow.evaluation.held_out import HeldOutData

NAME = "evaluate"


def load_evaluated_models(inputs: EvaluationInputs) -> EvaluatedModels:
    """The SFT model, the policy, the proxy and the judge, loaded once on the configured device."""
    from rlhflow.evaluation.compare import EvaluatedModels
    from rlhflow.models.loading import load_language_model, pick_device, resolve_precision
    from rlhflow.training.reward_model import RewardModel

    device = pick_device(inputs.device)
    tokenizer, sft = load_language_model(inputs.sft_dir, device)
    _, policy = load_language_model(inputs.policy_dir, device)  # the same tokenizer as SFT's
    return EvaluatedModels(
        device=device,
        dtype=resolve_precision(inputs.settings.precision, device),
        tokenizer=tokenizer,
        sft=sft,
        policy=policy,
        rm=RewardModel.load(inputs.proxy_dir, batch_size=inputs.proxy_batch_size, device=device),
        judge=load_evaluation_judge(inputs, device),
    )


def read_held_out_data(inputs: EvaluationInputs) -> HeldOutData:
    """The held-out prompts with the SFT model's answers to them, the test and dev pairs, and what the sft and
    reward_model stages saved about the test pairs (perplexity, pair scores)."""
    from rlhflow.data.readers import read_jsonl
    from rlhflow.evaluation.held_out import REFERENCE_FILE, HeldOutData, HeldOutPrompts, held_out_files, load_reference
    from rlhflow.evaluation.metrics import saved_held_out_perplexity
    from rlhflow.evaluation.pairs import saved_pair_scores

    settings, files = inputs.settings, held_out_files(inputs.validated_dir)
    held_out = HeldOutPrompts.load(files, settings.n_prompts, settings.samples_per_prompt)
    key = sft_answers_key(settings, held_out, files, inputs.sft_dir)
    test_file = files["test"]
    return HeldOutData(
        prompts=held_out,
        reference=load_reference(inputs.reference_dir / REFERENCE_FILE, key),
        test_rows=read_jsonl(test_file),
        dev_rows=read_jsonl(files["dev"]).to_dict("records") if "dev" in files else None,
        sft_perplexity=saved_held_out_perplexity(
            str(inputs.sft_dir), rows=settings.perplexity_rows, data_file=test_file
        ),
        test_pair_scores=saved_pair_scores(inputs.proxy_dir, data_file=test_file),
    )


def registered_head_to_head(client, name: str, has_dev: bool, compare):
    """`compare(model_dir, challenge)` against the registered version's model dir, on the dev split: the head to
    head that `promotion.challenge_champion` calls; None without a dev split (nothing is chosen on the test split)."""
    from rlhfops import registry

    def head_to_head(version, challenge: int):
        if not has_dev:
            return None
        with tempfile.TemporaryDirectory() as tmp:
            return compare(str(registry.registered_model_dir(client, name, version.version, tmp)), challenge)

    return head_to_head


def champion_decisions(inputs: EvaluationInputs, promote: str, client, evaluator: PolicyEvaluator, result) -> list:
    """The champion rule's decision for the registered reward model and policy this run trained, each against the
    version its alias points to (rlhflow/evaluation/champion.py); applied only once the stage succeeded."""
    from rlhflow.models.loading import load_language_model
    from rlhflow.training.reward_model import RewardModel
    from rlhfops import promotion, registry

    device = evaluator.models.device

    def policy_against(model_dir: str, challenge: int):
        tokenizer, other = load_language_model(model_dir, device)
        return evaluator.policy_against(result, other, tokenizer, challenge)

    def reward_model_against(model_dir: str, challenge: int):
        other = RewardModel.load(model_dir, batch_size=inputs.proxy_batch_size, device=device)
        return evaluator.reward_model_against(result, other, challenge)

    basis = evaluation_basis(inputs)
    challenges = [  # the reward model's figures do not depend on the judge
        (registry.REWARD_MODEL, inputs.proxy_dir, reward_model_against, ("train", "dev", "test")),
        (registry.POLICY, inputs.policy_dir, policy_against, ("train", "dev", "test", "judge")),
    ]
    decisions = []
    for name, model_dir, compare, basis_of in challenges:
        version = registry.version_of_model_dir(client, name, model_dir)
        if version is not None:
            own_basis = {k: v for k, v in basis.items() if k.startswith(basis_of)}
            head_to_head = registered_head_to_head(client, name, evaluator.data.dev_rows is not None, compare)
            decisions.append(
                promotion.challenge_champion(client, name, str(version.version), own_basis, head_to_head, promote)
            )
    return decisions


def run(cfg: Config, ctx: StageContext) -> dict[str, float]:
    import mlflow

    from rlhflow.evaluation import report
    from rlhflow.evaluation.compare import PolicyEvaluator
    from rlhflow.progress import ProgressLines
    from rlhfops import promotion, tracking

    inputs = evaluation_inputs(cfg)  # the stage's reading of params.yaml; what follows uses these values
    algorithm, promote = cfg.align.algorithm, cfg.evaluate.promote
    registering = cfg.tracking.log_models and cfg.tracking.register_models

    models, data = load_evaluated_models(inputs), read_held_out_data(inputs)
    evaluator = PolicyEvaluator(inputs.settings, models, data, lines=ProgressLines(NAME))
    result = evaluator.evaluate()
    ctx.log_metrics(result.metrics, on_parent=True)
    mlflow.set_tag("algorithm", algorithm)  # what made the policy (align.algorithm, one of its params)
    mlflow.log_table(result.samples, artifact_file="samples.json")

    client = tracking.client()
    decisions = champion_decisions(inputs, promote, client, evaluator, result) if registering else []

    # the judge stage's figures (the judge against the length rule), for the report
    judge_file = inputs.metrics_dir / "judge.json"
    judge_metrics = json.loads(judge_file.read_text()) if judge_file.exists() else {}
    report.write_outputs(
        inputs.report_dir, inputs.metrics_dir, inputs.settings.sampling, result, decisions, judge_metrics
    )
    mlflow.log_artifacts(str(inputs.report_dir), artifact_path="evaluation")

    # Last, once everything else succeeded: a failed evaluation moves no alias.
    for decision in decisions:
        promotion.apply_champion_decision(client, decision, run_id=ctx.run_id)
        mlflow.set_tag(f"champion/{decision.model}", f"v{decision.champion}" if decision.champion else "none")
    return result.metrics


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
