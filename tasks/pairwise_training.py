"""The training body the reward_model and judge stages share (tasks/reward_model.py, tasks/judge.py): train a
Bradley-Terry reward model on one validated split, score the held-out test pairs, log and register it. It lives
here, not in a stage module, so that neither stage module imports the other."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Protocol

from rlhflow.config.params import Config, JudgeConfig, RewardModelConfig
from rlhflow.fsutil import atomic_dir, prepare_checkpoint_dir, remove_made
from rlhflow.training import distributed
from rlhfops.hashing import inputs_fingerprint

# A light door: torch, transformers, mlflow, pandas and trl (the reward model's training and scoring, the readers, the
# tracking and registry) are imported inside the functions that use them, so the reward_model and judge stages answer
# --help and their checks before any of it loads.


class StageLog(Protocol):
    """What the body needs of the stage context (rlhfops/stage_runner.py StageContext): whether this process logs and
    writes (rank 0), and where its metrics go."""

    main_process: bool

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...


def backbone_spec(cfg: Config, rm_cfg: RewardModelConfig) -> str:
    return str(cfg.path(cfg.sft.out_dir)) if rm_cfg.backbone == "sft" else rm_cfg.backbone


def held_out_metrics(prefix: str, held_out: dict[str, float]) -> dict[str, float]:
    """A model's figures on the held-out test pairs (`rlhflow.evaluation.pairs.evaluate_pairs` metrics, or a judge's
    `rlhflow.evaluation.judges.pair_metrics`), under the stage's names: `<prefix>/accuracy`, `<prefix>/accuracy_se`,
    the length rule and its intervals, the soft scale where the model grades its preference, `<prefix>/eval_pairs`,
    and `<prefix>/margin` where scores give one."""
    from rlhflow.evaluation.pairs import pair_figures

    metrics = {
        f"{prefix}/accuracy": held_out["accuracy"],
        f"{prefix}/accuracy_se": held_out["accuracy_se"],
        **pair_figures(held_out, prefix),
    }
    if "margin_mean" in held_out:
        metrics[f"{prefix}/margin"] = held_out["margin_mean"]
    metrics[f"{prefix}/eval_pairs"] = held_out["pairs"]
    return metrics


def checkpoint_fingerprint(cfg: Config, rm_cfg: RewardModelConfig, train_files: list[Path], seed: int) -> str:
    """What a Trainer checkpoint must have been made from to be resumed: the same reward-model settings (where
    checkpoints go and how often aside), seed, backbone, training data and number of processes."""

    backbone = backbone_spec(cfg, rm_cfg)
    files = list(train_files)
    if Path(backbone).is_dir():
        files += sorted(Path(backbone).glob("*.safetensors"))
    settings = rm_cfg.model_dump(exclude={"out_dir", "checkpoint_dir", "checkpoint_every", "eval_batch_size"})
    return inputs_fingerprint(
        files, reward_model=settings, backbone=backbone, seed=seed, processes=distributed.world_size()
    )


def split_files(cfg: Config, split: str):
    """The validated split a pairwise model trains on, and the test split it is measured on."""
    validated = cfg.path(cfg.validate_.out_dir)
    train_file = validated / f"{split}.jsonl"
    if not train_file.exists():
        raise FileNotFoundError(f"{train_file}: no {split} split; run the validate stage first")
    return train_file, validated / "test.jsonl"


def resumable_checkpoint_dir(cfg: Config, ctx: StageLog, rm_cfg: RewardModelConfig, section: str, train_files, seed):
    """Trainer checkpoints of an interrupted run with the same inputs are resumed from; others are dropped (by the
    main process, before any process reads them)."""

    checkpoint_dir = cfg.path(rm_cfg.checkpoint_dir)
    if ctx.main_process:
        fingerprint = checkpoint_fingerprint(cfg, rm_cfg, train_files, seed)
        prepare_checkpoint_dir(checkpoint_dir, fingerprint, setting=f"{section}.checkpoint_dir")
    distributed.barrier()
    return checkpoint_dir


def training_rows(train_file: Path, labelled_repeats: int, main_process: bool) -> tuple[list[dict], list[Path], int]:
    """The split's rows, and beside them the labelled pairs validate wrote (labelled.jsonl, from people's labels)
    `labelled_repeats` times each; the files they come from (logged as the run's datasets); the labelled count."""
    from rlhflow.data.readers import read_jsonl
    from rlhfops import tracking

    rows, files = read_jsonl(train_file).to_dict("records"), [train_file]
    labelled_file = train_file.with_name("labelled.jsonl")
    labelled = read_jsonl(labelled_file).to_dict("records") if labelled_repeats and labelled_file.exists() else []
    if labelled:
        rows, files = rows + labelled * labelled_repeats, files + [labelled_file]
    if main_process:
        tracking.log_dataset(train_file, name=f"preferences-{train_file.stem}", context="training")
        if labelled:
            tracking.log_dataset(labelled_file, name="preferences-labelled", context="training")
    return rows, files, len(labelled)


def train_pairwise_model(
    cfg: Config,
    ctx: StageLog,
    rm_cfg: RewardModelConfig,
    *,
    split: str,
    prefix: str,
    model_name: str,
    registered_name: str,
    seed: int,
    labelled_repeats: int = 0,
) -> dict[str, float]:
    """Train a reward model (the proxy or the judge) on one validated split (and, `labelled_repeats` > 0, the
    labelled pairs), score the test split, log and register it (as `model_name` in the run, `registered_name` in the
    registry). Metrics are named `<prefix>/accuracy`, `<prefix>/accuracy_se`, `<prefix>/margin`, ..."""
    import mlflow

    from rlhflow.data.readers import read_jsonl
    from rlhflow.evaluation.pairs import evaluate_pairs, save_pair_scores
    from rlhflow.training.reward_model import train_reward_model
    from rlhfops import registry
    from rlhfops.serving.reward import RewardPyfunc

    train_file, test_file = split_files(cfg, split)
    train_rows, train_files, labelled = training_rows(train_file, labelled_repeats, ctx.main_process)
    test_rows = read_jsonl(test_file).to_dict("records")
    out_dir = cfg.path(rm_cfg.out_dir)
    # the other processes of a multi-process run write only into a scratch dir, which is thrown away
    section = "judge" if isinstance(rm_cfg, JudgeConfig) else "reward_model"  # the params keys named in errors
    output = atomic_dir(out_dir, setting=f"{section}.out_dir") if ctx.main_process else tempfile.TemporaryDirectory()
    checkpoint_dir = resumable_checkpoint_dir(cfg, ctx, rm_cfg, section, train_files, seed)
    with output as tmp:
        rm = train_reward_model(
            rm_cfg,
            train_rows,
            backbone=backbone_spec(cfg, rm_cfg),
            out_dir=tmp,
            work_dir=checkpoint_dir,
            seed=seed,
            log_fn=lambda m, step: ctx.log_metrics({f"{prefix}/{k}": v for k, v in m.items()}, step=step),
            trust_remote_code=cfg.sft.trust_remote_code,
            what="judge" if section == "judge" else "reward model",  # how its lines in the run log begin
        )
        if rm is None:  # not the main process: its part of the training is done
            return {}
        pairs = evaluate_pairs(rm, test_rows)
        save_pair_scores(tmp, pairs, data_file=test_file)  # evaluate measures this model on the same pairs
        metrics = {
            **held_out_metrics(prefix, pairs.metrics),
            f"{prefix}/train_pairs": float(len(train_rows)),
            **({f"{prefix}/labelled_pairs": float(labelled)} if labelled else {}),
            f"{prefix}/score_mean": rm.mean,
            f"{prefix}/score_std": rm.std,
        }
    ctx.log_metrics(metrics)
    mlflow.log_dict({"normalization": {"mean": rm.mean, "std": rm.std}}, "reward_normalization.json")
    registry.log_model_dir(cfg, out_dir, name=model_name, wrapper=RewardPyfunc, registered_name=registered_name)
    remove_made(checkpoint_dir)  # logged and registered: nothing left to resume
    return metrics
