"""What the stages that evaluate (sft_answers, evaluate, feedback) and the sweep's best-of-n baseline read from
params.yaml, once (`evaluation_inputs`): the evaluation's settings as values and its directories resolved. The
loaders here take those values; the library (rlhflow.evaluation) gets the settings, the loaded models and the rows,
never the configuration or a path to resolve."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlhflow.config.params import Config, JudgeConfig
from rlhflow.fsutil import dir_md5, file_md5

# A light door: what loads torch, transformers and pandas (rlhflow.evaluation, rlhflow.models) is imported inside the
# functions that use it, so the stages that import this module answer --help and their checks before any of it loads.
if TYPE_CHECKING:
    from rlhflow.evaluation.held_out import HeldOutPrompts
    from rlhflow.evaluation.settings import EvaluationSettings
    from rlhflow.models.sampling import Sampling


@dataclass(frozen=True)
class EvaluationInputs:
    """An evaluating stage's reading of params.yaml: the settings, the device's name and every directory resolved."""

    settings: EvaluationSettings
    device: str  # the `device` setting: auto, cpu, cuda, ...
    sft_dir: Path  # the SFT model (sft.out_dir)
    policy_dir: Path  # the evaluated policy (ppo.out_dir)
    proxy_dir: Path  # the proxy reward model (reward_model.out_dir)
    proxy_batch_size: int
    judge: JudgeConfig  # the judge section: which judge, and its settings
    judge_dir: Path  # the trained judge (judge.out_dir)
    validated_dir: Path  # the split files validate wrote
    reference_dir: Path  # the sft_answers stage's answers
    metrics_dir: Path
    report_dir: Path


def evaluation_inputs(cfg: Config) -> EvaluationInputs:
    return EvaluationInputs(
        settings=evaluation_settings(cfg),
        device=cfg.device,
        sft_dir=cfg.path(cfg.sft.out_dir),
        policy_dir=cfg.path(cfg.ppo.out_dir),
        proxy_dir=cfg.path(cfg.reward_model.out_dir),
        proxy_batch_size=cfg.reward_model.eval_batch_size,
        judge=cfg.judge,
        judge_dir=cfg.path(cfg.judge.out_dir),
        validated_dir=cfg.path(cfg.validate_.out_dir),
        reference_dir=cfg.path(cfg.evaluate.reference_dir),
        metrics_dir=cfg.path(cfg.metrics_dir),
        report_dir=cfg.path(cfg.evaluate.report_dir),
    )


def evaluation_sampling(cfg: Config) -> Sampling:
    """evaluate's temperature (default: PPO's), top-p (default: PPO's), repetition penalty and its own seed
    (`evaluate.seed`), PPO's prompt cut, top-k, stop strings and KV cache. Every model compared samples on the same
    random streams; a training-seed sweep keeps the same streams."""
    from rlhflow.models.sampling import Sampling

    e, p = cfg.evaluate, cfg.ppo
    return Sampling(
        temperature=cfg.eval_temperature,
        top_k=p.top_k,
        top_p=e.top_p if e.top_p is not None else p.top_p,
        repetition_penalty=e.repetition_penalty,
        max_new_tokens=e.max_new_tokens,
        max_prompt_length=p.max_prompt_length,
        stop_strings=tuple(p.stop_strings),
        seed=e.seed,
        batch_size=e.batch_size,
        kv_cache=p.kv_cache,
    )


def evaluation_settings(cfg: Config) -> EvaluationSettings:
    from rlhflow.evaluation.settings import EvaluationSettings

    e = cfg.evaluate
    return EvaluationSettings(
        sampling=evaluation_sampling(cfg),
        precision=e.precision,
        temperature=cfg.eval_temperature,
        n_prompts=e.n_prompts,
        samples_per_prompt=e.samples_per_prompt,
        degenerate_repetition=e.degenerate_repetition,
        dev_figures=e.dev_figures,
        score_batch_size=e.score_batch_size,
        perplexity_rows=e.perplexity_rows,
        missing_eos_penalty=cfg.ppo.missing_eos_penalty,
        champion=e.champion,
    )


def load_evaluation_judge(inputs: EvaluationInputs, device):
    """The judge (the judge section: a trained reward model, a scoring function or an LLM endpoint)."""
    from rlhflow.evaluation.judges import load_judge

    return load_judge(inputs.judge, inputs.judge_dir, batch_size=inputs.judge.eval_batch_size, device=device)


def evaluation_basis(inputs: EvaluationInputs) -> dict[str, str]:
    """What a registered model's figures were measured on: the split files and the judge
    (rlhflow/evaluation/champion.py)."""
    basis = {
        f"{split}_split_md5": file_md5(path) if path.exists() else "none"
        for split in ("train", "dev", "test")
        for path in [inputs.validated_dir / f"{split}.jsonl"]
    }
    basis["judge_md5"] = dir_md5(inputs.judge_dir)
    return basis


def sft_answers_key(
    settings: EvaluationSettings, held_out: HeldOutPrompts, files: dict[str, Path], sft_dir: Path
) -> dict:
    """What the sft_answers stage's answers to `held_out`, drawn from the split `files`, are keyed by
    (rlhflow.evaluation.held_out.reference_key)."""
    from rlhflow.evaluation.held_out import reference_key

    return reference_key(
        settings,
        sft_md5=dir_md5(sft_dir),
        held_out_md5={split: file_md5(path) for split, path in files.items()},
        prompts=held_out.counts,
        splits=list(held_out.answered(settings.dev_figures)),
    )


def sft_in_precision(sft_dir: Path, precision: str, device):
    """The SFT model and its tokenizer, the model in the sampling precision: (tokenizer, model)."""
    from rlhflow.evaluation.held_out import as_precision
    from rlhflow.models.loading import load_language_model, resolve_precision

    tokenizer, sft = load_language_model(sft_dir, device)
    return tokenizer, as_precision(sft, resolve_precision(precision, device))
