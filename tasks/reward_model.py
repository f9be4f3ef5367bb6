"""Stage reward_model: train a Bradley-Terry reward model with trl's RewardTrainer on the validated train
pairs; report pairwise accuracy on held-out pairs (and on real human preference pairs from hh-rlhf when
that file is present); register the model as `rlhf-reward-model` (alias `candidate`)."""

from __future__ import annotations

from rlhflow.config import Config
from tasks._common import StageContext, cli, stage_task

NAME = "reward_model"
REGISTERED_NAME = "rlhf-reward-model"


def backbone_spec(cfg: Config) -> str:
    return str(cfg.path(cfg.sft.out_dir)) if cfg.reward_model.backbone == "sft" else cfg.reward_model.backbone


def checkpoint_fingerprint(cfg: Config) -> str:
    """What a Trainer checkpoint must have been made from to be resumed: the same reward-model settings (where
    checkpoints go and how often aside), seed, backbone, training data and number of processes."""
    import json
    from pathlib import Path

    from rlhflow import distributed
    from rlhflow.fsutil import file_stamps

    rm_cfg, backbone = cfg.reward_model, backbone_spec(cfg)
    files = [cfg.path(cfg.validate_.out_dir) / "train.jsonl"]
    if rm_cfg.hh_train_rows and rm_cfg.hh_eval_path:
        files.append(cfg.path(rm_cfg.hh_eval_path))
    if Path(backbone).is_dir():
        files += sorted(Path(backbone).glob("*.safetensors"))
    settings = rm_cfg.model_dump(exclude={"out_dir", "checkpoint_dir", "checkpoint_every", "eval_batch_size"})
    return json.dumps({"reward_model": settings, "backbone": backbone, "seed": cfg.seed, "inputs": file_stamps(files),
                       "processes": distributed.world_size()}, sort_keys=True)


def run(cfg: Config, ctx: StageContext) -> dict[str, float]:
    import shutil
    import tempfile

    import mlflow

    from rlhflow import distributed, tracking
    from rlhflow.data.formats import load_preferences, read_jsonl
    from rlhflow.fsutil import atomic_dir, prepare_checkpoint_dir
    from rlhflow.reward import evaluate_pairs, train_reward_model

    rm_cfg = cfg.reward_model
    validated = cfg.path(cfg.validate_.out_dir)
    train_rows = read_jsonl(validated / "train.jsonl").to_dict("records")
    test_rows = read_jsonl(validated / "test.jsonl").to_dict("records")

    hh_rows: list[dict] = []
    hh_path = cfg.path(rm_cfg.hh_eval_path) if rm_cfg.hh_eval_path else None
    if hh_path and hh_path.exists():
        hh = load_preferences(str(hh_path)).to_dict("records")
        hh_rows = hh[-rm_cfg.hh_eval_rows:]  # held out: taken from the end, training rows from the start
        train_rows = train_rows + hh[: min(rm_cfg.hh_train_rows, len(hh) - len(hh_rows))]

    if ctx.main_process:
        tracking.log_dataset(validated / "train.jsonl", name="preferences-train", context="training")
    out_dir = cfg.path(rm_cfg.out_dir)
    # the other processes of a multi-process run write only into a scratch dir, which is thrown away
    output = atomic_dir(out_dir) if ctx.main_process else tempfile.TemporaryDirectory()
    # Trainer checkpoints of an interrupted run with the same inputs are resumed from; others are dropped
    checkpoint_dir = cfg.path(rm_cfg.checkpoint_dir)
    if ctx.main_process:
        prepare_checkpoint_dir(checkpoint_dir, checkpoint_fingerprint(cfg))
    distributed.barrier()
    with output as tmp:
        rm = train_reward_model(rm_cfg, train_rows, backbone=backbone_spec(cfg), out_dir=tmp,
                                work_dir=checkpoint_dir, seed=cfg.seed,
                                log_fn=lambda m, step: ctx.log_metrics(m, step=step),
                                trust_remote_code=cfg.sft.trust_remote_code)
        if rm is None:  # not the main process: its part of the training is done
            return {}
        held_out = evaluate_pairs(rm, test_rows)
        metrics = {"rm/accuracy": held_out["accuracy"], "rm/margin": held_out["margin_mean"],
                   "rm/eval_pairs": held_out["pairs"], "rm/train_pairs": float(len(train_rows)),
                   "rm/score_mean": rm.mean, "rm/score_std": rm.std}
        if hh_rows:
            hh_eval = evaluate_pairs(rm, hh_rows)
            metrics.update({"rm/accuracy_hh": hh_eval["accuracy"], "rm/margin_hh": hh_eval["margin_mean"]})
    shutil.rmtree(checkpoint_dir, ignore_errors=True)  # finished: nothing left to resume
    ctx.log_metrics(metrics)
    mlflow.log_dict({"normalization": {"mean": rm.mean, "std": rm.std}}, "reward_normalization.json")
    tracking.log_model_dir(cfg, out_dir, name="reward_model", kind="reward", registered_name=REGISTERED_NAME)
    return metrics


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
