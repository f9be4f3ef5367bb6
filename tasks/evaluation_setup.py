"""What the stages that evaluate (sft_answers, evaluate) and the sweep's best-of-n baseline read from params.yaml, once:
the evaluation's settings as values, the models loaded and the held-out prompts read. The library
(rlhflow.evaluation) gets these, never the configuration or a path to resolve."""

from __future__ import annotations

from pathlib import Path

from rlhflow.config.params import Config
from rlhflow.evaluation.held_out import HeldOutPrompts, as_precision, held_out_files, reference_key
from rlhflow.evaluation.judges import load_judge
from rlhflow.evaluation.settings import EvaluationSettings
from rlhflow.fsutil import dir_md5, file_md5
from rlhflow.models.loading import load_causal_lm, load_tokenizer, resolve_precision
from rlhflow.models.sampling import Sampling
from rlhflow.training.reward_model import RewardModel


def evaluation_sampling(cfg: Config) -> Sampling:
    """evaluate's temperature (default: PPO's), top-p (default: PPO's), repetition penalty and its own seed
    (`evaluate.seed`), PPO's prompt cut, top-k, stop strings and KV cache. Every model compared samples on the same
    random streams; a training-seed sweep keeps the same streams."""
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
    e = cfg.evaluate
    return EvaluationSettings(
        sampling=evaluation_sampling(cfg),
        precision=e.precision,
        temperature=cfg.eval_temperature,
        n_prompts=e.n_prompts,
        samples_per_prompt=e.samples_per_prompt,
        degenerate_repetition=e.degenerate_repetition,
        score_batch_size=e.score_batch_size,
        perplexity_rows=e.perplexity_rows,
        missing_eos_penalty=cfg.ppo.missing_eos_penalty,
        champion=e.champion,
    )


def load_language_model(model_dir: str | Path, device):
    """A causal LM saved by a stage (or registered), with its own tokenizer, for sampling: (tokenizer, model)."""
    tokenizer = load_tokenizer(str(model_dir))
    model = load_causal_lm(str(model_dir), pad_token_id=tokenizer.pad_token_id).to(device).eval()
    return tokenizer, model


def load_proxy(model_dir: str | Path, cfg: Config, device) -> RewardModel:
    """A proxy reward model (the reward_model stage's, or a registered one) as the evaluation scores with it."""
    return RewardModel.load(model_dir, batch_size=cfg.reward_model.eval_batch_size, device=device)


def load_evaluation_judge(cfg: Config, device):
    """The judge (the judge section: a trained reward model, a scoring function or an LLM endpoint)."""
    return load_judge(cfg.judge, cfg.path(cfg.judge.out_dir), batch_size=cfg.judge.eval_batch_size, device=device)


def held_out_split_files(cfg: Config) -> dict[str, Path]:
    """The held-out split files validate wrote (rlhflow.evaluation.held_out.held_out_files)."""
    return held_out_files(cfg.path(cfg.validate_.out_dir))


def sft_answers_key(
    settings: EvaluationSettings, held_out: HeldOutPrompts, files: dict[str, Path], sft_dir: Path
) -> dict:
    """What the sft_answers stage's answers to `held_out`, drawn from the split `files`, are keyed by
    (rlhflow.evaluation.held_out.reference_key)."""
    return reference_key(
        settings,
        sft_md5=dir_md5(sft_dir),
        held_out_md5={split: file_md5(path) for split, path in files.items()},
        prompts=held_out.counts,
    )


def sft_in_precision(cfg: Config, precision: str, device):
    """The SFT model and its tokenizer, the model in the sampling precision: (tokenizer, model)."""
    tokenizer, sft = load_language_model(cfg.path(cfg.sft.out_dir), device)
    return tokenizer, as_precision(sft, resolve_precision(precision, device))
