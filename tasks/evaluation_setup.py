"""The evaluation's settings read from params.yaml once, for the stages that evaluate (sft_answers, evaluate) and
the sweep's best-of-n baseline: the library (rlhflow.evaluation) gets these values, never the configuration."""

from __future__ import annotations

from rlhflow.config.params import Config
from rlhflow.evaluation.setup import EvaluationSetup
from rlhflow.models.sampling import Sampling


def evaluation_sampling(cfg: Config) -> Sampling:
    """evaluate's temperature (default: PPO's), top-p (default: PPO's), repetition penalty and its own seed
    (`evaluate.seed`), PPO's prompt cut, top-k and stop strings. Every model compared samples on the same random
    streams; a training-seed sweep keeps the same streams."""
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
    )


def evaluation_setup(cfg: Config) -> EvaluationSetup:
    e = cfg.evaluate
    return EvaluationSetup(
        sft_dir=cfg.path(cfg.sft.out_dir),
        policy_dir=cfg.path(cfg.ppo.out_dir),
        reward_model_dir=cfg.path(cfg.reward_model.out_dir),
        judge=cfg.judge,
        judge_dir=cfg.path(cfg.judge.out_dir),
        device=cfg.device,
        validated_dir=cfg.path(cfg.validate_.out_dir),
        reference_dir=cfg.path(e.reference_dir),
        sampling=evaluation_sampling(cfg),
        precision=e.precision,
        temperature=cfg.eval_temperature,
        n_prompts=e.n_prompts,
        samples_per_prompt=e.samples_per_prompt,
        degenerate_repetition=e.degenerate_repetition,
        score_batch_size=e.score_batch_size,
        reward_model_batch_size=cfg.reward_model.eval_batch_size,
        judge_batch_size=cfg.judge.eval_batch_size,
        perplexity_rows=e.perplexity_rows,
        missing_eos_penalty=cfg.ppo.missing_eos_penalty,
        champion=e.champion,
        report_dir=cfg.path(e.report_dir),
        metrics_dir=cfg.path(cfg.metrics_dir),
    )
