"""Stage judge: the evaluation's independent judge (judge.kind, rlhflow/evaluation/judges.py; docs/evaluation.md).

- trained (the default): a second Bradley-Terry reward model on the judge split, whose conversations the proxy
  reward model and PPO never see; PPO never optimises against it, so reward hacking of the proxy does not inflate
  its win rate. Registered as `rlhf-judge`.
- reward_model or llm: a judge the user brings (a Hugging Face reward model, a chat model behind an
  OpenAI-compatible endpoint); the stage checks it, writes judge.json (what it is, the champion rule's basis).
Either way its accuracy on the held-out test pairs, beside the length rule, is logged (judge/accuracy, ...).
"""

from __future__ import annotations

from rlhflow.config.params import Config
from rlhflow.fsutil import atomic_dir, write_json_atomic
from rlhfops.stage_runner import StageContext, cli, stage_task
from tasks.pairwise_training import held_out_metrics, train_pairwise_model

# A light door: torch, transformers, mlflow and pandas (the judges, the readers, the tracking and registry) are
# imported inside the functions that use them, so the stage's --help and its checks answer before any of them loads.

NAME = "judge"


def run(cfg: Config, ctx: StageContext) -> dict[str, float]:
    from rlhflow.evaluation import judging
    from rlhflow.evaluation.pairs import LENGTH_AWARE_METRICS, SOFT_PAIR_METRICS
    from rlhfops import registry

    if cfg.judge.kind != "trained" and not ctx.main_process:
        return {}  # nothing to train: the main process measures the judge alone
    judging.preflight(cfg.judge)  # an unreachable endpoint or a model that is no reward model fails in seconds
    if cfg.judge.kind == "trained":
        # its own seed, not the training seed: runs of a seed sweep are judged by the same model
        metrics = train_pairwise_model(
            cfg,
            ctx,
            cfg.judge,
            split="judge",
            prefix="judge",
            model_name=NAME,
            registered_name=registry.JUDGE,
            seed=cfg.judge.seed,
        )
    else:
        metrics = measure_given_judge(cfg, ctx)
    figures = ("accuracy", "accuracy_se", *LENGTH_AWARE_METRICS, *SOFT_PAIR_METRICS)
    on_parent = {f"judge/{k}" for k in figures}
    ctx.log_metrics({k: v for k, v in metrics.items() if k in on_parent}, on_parent=True)
    return metrics


def measure_given_judge(cfg: Config, ctx: StageContext) -> dict[str, float]:
    """A judge this stage does not train: what it is (params, and judge.json in judge.out_dir with its basis) and
    its accuracy on the held-out test pairs, measured and named as the trained judge's is."""
    import mlflow

    from rlhflow.data.readers import read_jsonl
    from rlhflow.evaluation import judges
    from rlhflow.models.loading import pick_device
    from rlhfops import tracking

    test_file = cfg.path(cfg.validate_.out_dir) / "test.jsonl"
    if not test_file.exists():
        raise FileNotFoundError(f"{test_file}: no test split; run the validate stage first")
    rows = read_jsonl(test_file).to_dict("records")
    tracking.log_dataset(test_file, name="preferences-test", context="evaluation")

    out_dir = cfg.path(cfg.judge.out_dir)
    judge = judges.load_judge(cfg.judge, out_dir, batch_size=cfg.judge.eval_batch_size, device=pick_device(cfg.device))
    description = judge.describe()
    mlflow.log_params(description)
    held_out, verdicts = judges.pair_metrics(judge, rows)
    record = {"describe": description, "basis_md5": judge.basis_md5()}
    with atomic_dir(out_dir, setting="judge.out_dir") as tmp:
        write_json_atomic(tmp / judges.JUDGE_FILE, record)
    mlflow.log_dict(record, judges.JUDGE_FILE)

    metrics = held_out_metrics("judge", held_out)
    if not judge.pointwise:
        metrics["judge/malformed_replies"] = held_out["malformed_replies"]
        if verdicts.malformed_items:
            malformed = [{"pair": i, "prompt": rows[i]["prompt_messages"]} for i in verdicts.malformed_items]
            mlflow.log_dict({"malformed_items": malformed}, "judge_malformed.json")
            print(
                f"judge: {verdicts.malformed} replies stayed malformed after judge.max_retries retries, on test pairs "
                f"{verdicts.malformed_items[:20]}{' ...' if len(verdicts.malformed_items) > 20 else ''} (counted as "
                "ties; listed in the run's judge_malformed.json)"
            )
    ctx.log_metrics(metrics)
    return metrics


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
