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

# Heavy imports (mlflow, the library's model code) are deferred into the stage body, so that importing the module
# (the flow does, to get its task; so does `--help`) stays fast.
import json
import tempfile

from rlhflow.config.params import Config
from rlhfops import registry
from rlhfops.stage_runner import StageContext, cli, stage_task

NAME = "evaluate"


def evaluation_basis(cfg: Config) -> dict[str, str]:
    """What a registered model's figures were measured on: the split files and the judge
    (rlhflow/evaluation/champion.py)."""
    from rlhfops.hashing import dir_md5, file_md5

    validated = cfg.path(cfg.validate_.out_dir)
    basis = {
        f"{split}_split_md5": file_md5(path) if path.exists() else "none"
        for split in ("train", "dev", "test")
        for path in [validated / f"{split}.jsonl"]
    }
    basis["judge_md5"] = dir_md5(cfg.path(cfg.judge.out_dir))
    return basis


def run(cfg: Config, ctx: StageContext) -> dict[str, float]:
    import mlflow

    from rlhflow.evaluation import compare as ev
    from rlhflow.evaluation import report
    from rlhfops import promotion
    from tasks.evaluation_setup import evaluation_setup

    setup = evaluation_setup(cfg)
    result = ev.evaluate(setup)
    ctx.log_metrics(result.metrics, on_parent=True)
    mlflow.set_tag("algorithm", cfg.align.algorithm)  # what made the policy (align.algorithm, one of its params)
    mlflow.log_table(result.samples, artifact_file="samples.json")

    client = mlflow.MlflowClient()

    def against_champion(name: str, compare):
        """`compare(result, setup, model_dir, challenge)` against the registered version's model dir, on the dev
        split."""

        def head_to_head(version, challenge: int):
            if result.dev is None:  # nothing is chosen on the test split
                return None
            with tempfile.TemporaryDirectory() as tmp:
                model_dir = str(registry.registered_model_dir(client, name, version.version, tmp))
                return compare(result, setup, model_dir, challenge)

        return head_to_head

    decisions = []
    if cfg.tracking.log_models and cfg.tracking.register_models:
        basis = evaluation_basis(cfg)
        challenges = [  # the reward model's figures do not depend on the judge
            (registry.REWARD_MODEL, cfg.reward_model.out_dir, ev.reward_model_against, ("train", "dev", "test")),
            (registry.POLICY, cfg.ppo.out_dir, ev.policy_against, ("train", "dev", "test", "judge")),
        ]
        for name, out_dir, compare, basis_of in challenges:
            version = registry.version_of_model_dir(client, name, cfg.path(out_dir))
            if version is not None:
                own_basis = {k: v for k, v in basis.items() if k.startswith(basis_of)}
                head_to_head = against_champion(name, compare)
                decisions.append(
                    promotion.challenge_champion(
                        client, name, str(version.version), own_basis, head_to_head, cfg.evaluate.promote
                    )
                )

    # the judge stage's figures (the judge against the length rule), for the report
    judge_file = setup.metrics_dir / "judge.json"
    judge_metrics = json.loads(judge_file.read_text()) if judge_file.exists() else {}
    report.write_outputs(setup, result, decisions, judge_metrics)
    mlflow.log_artifacts(str(setup.report_dir), artifact_path="evaluation")

    # Last, once everything else succeeded: a failed evaluation moves no alias.
    for decision in decisions:
        promotion.apply_champion_decision(client, decision, run_id=ctx.run_id)
        mlflow.set_tag(f"champion/{decision.model}", f"v{decision.champion}" if decision.champion else "none")
    return result.metrics


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
