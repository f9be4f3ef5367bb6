"""How the pipeline samples a model outside PPO's rollouts (the SFT stage's samples, evaluation, best-of-n). One place,
so the stages cannot drift apart.

- `sample_responses`: `generate` over all prompts in batches, each batch on its own seeded random stream; ended
  answers leave their batch (`rlhflow.models.decoding`), so a batch's cost follows its answers' lengths.
- `Sampling`: every setting of one sampling run. PPO must sample the full softmax (its ratios and KL assume it);
  evaluation need not: `evaluate.top_p` and `evaluate.repetition_penalty` may change what the compared models say,
  the same way for both. The stages build theirs from params.yaml (tasks/evaluation_setup.py, tasks/sft.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal

from rlhflow.models.generation import GenerationOutput, first_rows, generate
from rlhflow.models.kv_cache import KVCache
from rlhflow.models.policy import Messages, encode_prompts

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase


def sample_responses(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompt_messages: Sequence[Messages | str],
    *,
    batch_size: int,
    max_prompt_length: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_strings: Sequence[str] = (),
    seed: int | None = None,
    repetition_penalty: float = 1.0,
    drop_finished: bool = True,
    draw: str = "inverse_cdf",
    kv_cache: KVCache = "preallocated",
    rows: int | None = None,
    lines: Callable[[str | Callable[[], str]], None] | None = None,
) -> list[GenerationOutput]:
    """`generate` over all prompts in batches of `batch_size`, on the model's device. Batch i samples with seed
    `seed + i`, so two models given the same prompts and seed are compared on the same random streams.
    drop_finished False: transformers' own `generate`, which keeps ended rows until the batch's last one ends;
    True: `draw` picks each token (rlhflow.models.decoding.DRAWS). kv_cache: rlhflow.models.kv_cache.
    rows: the answers to the first `rows` prompts alone, each the one sampling every prompt gives: the batches that
    hold them are sampled whole (their other rows share the random stream) and the outputs cut after row `rows`.
    lines: a progress line writer (rlhflow.progress.ProgressLines), told the batch, token and rows still sampling."""
    device = next(model.parameters()).device
    wanted = len(prompt_messages) if rows is None else min(rows, len(prompt_messages))
    outs = []
    for start in range(0, wanted, batch_size):
        query, mask = encode_prompts(tokenizer, prompt_messages[start : start + batch_size], max_prompt_length)
        where = f"answers: batch {start // batch_size + 1} of {-(-wanted // batch_size)}"
        outs.append(
            generate(
                model,
                tokenizer,
                query.to(device),
                mask.to(device),
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                stop_strings=stop_strings,
                generator_seed=None if seed is None else seed + start,
                repetition_penalty=repetition_penalty,
                drop_finished=drop_finished,
                draw=draw,
                kv_cache=kv_cache,
                on_step=_progress(lines, where, max_new_tokens, len(query)) if lines else None,
            )
        )
    if outs and wanted < len(prompt_messages):
        outs[-1] = first_rows(outs[-1], wanted - batch_size * (len(outs) - 1))
    return outs


def _progress(lines, where: str, max_new_tokens: int, rows: int):
    """A decoder's on_step that tells `lines` where a batch is: its token and the rows still sampling."""
    return lambda tokens, live: lines(
        lambda: f"{where}, token {tokens} of {max_new_tokens}, {live} of {rows} still sampling"
    )


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    max_new_tokens: int
    max_prompt_length: int
    stop_strings: tuple[str, ...]
    seed: int | None
    batch_size: int
    # rlhflow.models.decoding, or transformers' "generate"; the tokens differ between the two at one seed
    decoder: Literal["drop_finished", "generate"] = "drop_finished"
    # how drop_finished draws each token (rlhflow.models.decoding.DRAWS): the same distribution, different tokens
    draw: Literal["inverse_cdf", "multinomial"] = "inverse_cdf"
    # rlhflow.models.kv_cache (ppo.kv_cache): preallocated and dynamic draw the same tokens; compiled other
    # tokens at one seed (its batch holds extra rows), the same when greedy
    kv_cache: KVCache = "preallocated"

    def key(self) -> dict:
        """What the sampled answers depend on, besides the model and the prompts (batch_size too: a batch's rows
        share one random stream; the decoder too: which rows share each draw)."""
        return {**asdict(self), "stop_strings": list(self.stop_strings)}

    def sample(self, model, tokenizer, prompt_messages, rows: int | None = None, lines=None) -> list[GenerationOutput]:
        """The answers to `prompt_messages`; to the first `rows` of them alone, as sampling them all gives them
        (`sample_responses`); `lines` writes progress lines."""
        return sample_responses(
            model,
            tokenizer,
            prompt_messages,
            batch_size=self.batch_size,
            max_prompt_length=self.max_prompt_length,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            stop_strings=list(self.stop_strings),
            seed=self.seed,
            repetition_penalty=self.repetition_penalty,
            drop_finished=self.decoder == "drop_finished",
            draw=self.draw,
            kv_cache=self.kv_cache,
            rows=rows,
            lines=lines,
        )
