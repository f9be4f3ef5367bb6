"""How the pipeline samples a model outside PPO's rollouts (the SFT stage's samples, evaluation, best-of-n): as PPO
samples (its prompt cut, top-k / top-p and stop strings) at the evaluation temperature, with the run's seed, so
every model compared is sampled on the same random streams. One place, so the stages cannot drift apart."""

from __future__ import annotations

from rlhflow.config import Config
from rlhflow.policy import GenerationOutput, sample_responses


def sample(
    model, tokenizer, prompt_messages, cfg: Config, *, batch_size: int, max_new_tokens: int
) -> list[GenerationOutput]:
    return sample_responses(
        model,
        tokenizer,
        prompt_messages,
        batch_size=batch_size,
        max_prompt_length=cfg.ppo.max_prompt_length,
        max_new_tokens=max_new_tokens,
        temperature=cfg.eval_temperature,
        top_k=cfg.ppo.top_k,
        top_p=cfg.ppo.top_p,
        stop_strings=cfg.ppo.stop_strings,
        seed=cfg.seed,
    )
