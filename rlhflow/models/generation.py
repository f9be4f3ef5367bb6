"""Sampling responses from a causal LM (`generate`), for PPO's rollouts, the SFT samples and the evaluation.

A response ends at the first EOS (any of `eos_token_ids`: the tokenizer's and those the model's generation_config
lists), stop string that is a single vocabulary token, or token that completes a stop string; that token is kept as
the last real token (it carries the score) and everything after it becomes pad. A stop string counts when it ends
inside the response, also one that the prompt begins (transformers stops such a row too); never one wholly inside
the prompt. `texts` are decoded without special tokens and cut before the stop string; `ended` says which rows
finished by themselves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedTokenizerBase
from transformers.generation import StoppingCriteria, StoppingCriteriaList, StopStringCriteria

from rlhflow.models.decoding import DRAWS, logits_processors, sample_dropping_finished
from rlhflow.models.kv_cache import KVCache, compile_config, new_kv_cache
from rlhflow.models.loading import autocast, unwrap_peft
from rlhflow.models.packed_linear import packed_linears


@dataclass
class GenerationOutput:
    query_response: torch.Tensor  # [B, P+T] prompt (left-padded) followed by response (right-padded)
    response: torch.Tensor  # [B, T] response ids, pad id after the end
    response_mask: torch.Tensor  # [B, T] 1 on real response tokens (EOS / stop-string token included)
    ended: torch.Tensor  # [B] bool: emitted EOS or a stop string (False: ran into max_new_tokens)
    texts: list[str] = field(default_factory=list)  # responses decoded without special tokens, cut at stop strings
    attention_mask: torch.Tensor | None = None  # [B, P+T] prompt mask followed by response_mask
    # with generate(return_logits=True / return_hidden=True), from the sampling pass itself:
    logits: torch.Tensor | None = None  # [B, T, V] raw logits (before temperature) that predicted each response token
    hidden: torch.Tensor | None = None  # [B, T, H] last hidden state s_t from which response token t was sampled

    @property
    def context_length(self) -> int:
        return self.query_response.shape[1] - self.response.shape[1]


def first_rows(out: GenerationOutput, rows: int) -> GenerationOutput:
    """The first `rows` rows of a sampled batch, every per-row field cut alike (columns as they are)."""

    def cut(x):
        return None if x is None else x[:rows]

    return GenerationOutput(
        query_response=out.query_response[:rows],
        response=out.response[:rows],
        response_mask=out.response_mask[:rows],
        ended=out.ended[:rows],
        texts=out.texts[:rows],
        attention_mask=cut(out.attention_mask),
        logits=cut(out.logits),
        hidden=cut(out.hidden),
    )


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model_or_generation_config=None) -> list[int]:
    """Every token id that ends a response: the tokenizer's EOS and each EOS id the model's generation_config lists
    (an int or a list; Llama-3 and Qwen instruct models list several, e.g. an end-of-turn besides end-of-text)."""
    config = getattr(model_or_generation_config, "generation_config", model_or_generation_config)
    listed = getattr(config, "eos_token_id", None)
    listed = [listed] if isinstance(listed, int) else list(listed or [])
    ids = []
    for i in [tokenizer.eos_token_id, *listed]:
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    return ids


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model, stop_strings: Sequence[str] = ()) -> list[int]:
    """The EOS ids (`eos_token_ids`) plus the stop strings that are single tokens of the vocabulary (e.g.
    '<|eot_id|>')."""
    ids = eos_token_ids(tokenizer, model)
    vocab = tokenizer.get_vocab()
    for s in stop_strings:
        if s in vocab and vocab[s] not in ids:
            ids.append(vocab[s])
    return ids


def _stop_string_start(prompt_tail: str, text: str, stop_strings: Sequence[str]) -> int | None:
    """Where in `text` the earliest stop string that ends inside it starts (negative: it began in `prompt_tail`, the
    end of the prompt), or None. A stop string wholly inside the prompt does not count."""
    joined = prompt_tail + text
    starts = []
    for s in stop_strings:
        at = joined.find(s, max(0, len(prompt_tail) - len(s) + 1))  # the match must end after the prompt
        if at >= 0:
            starts.append(at - len(prompt_tail))
    return min(starts) if starts else None


def _cut_response(
    tokenizer,
    ids: list[int],
    eos_ids: set[int],
    stop_strings: Sequence[str],
    *,
    prompt_tail: str = "",
    stopped_after: int | None = None,
) -> tuple[int, bool, str]:
    """(number of tokens kept, ended, text) for one sampled response.

    prompt_tail: the end of the decoded prompt, so that a stop string which the prompt begins and the response
    completes counts, as transformers' StopStringCriteria counts it (then the text is cut at the response's start).
    stopped_after: the number of tokens generated before generation stopped this row on a stop string; what follows
    is padding and is never kept."""
    if stopped_after is not None:
        ids = ids[:stopped_after]
    eos_at = next((i for i, t in enumerate(ids) if t in eos_ids), None)
    body = ids if eos_at is None else ids[:eos_at]
    text = tokenizer.decode(body, skip_special_tokens=True)
    start = _stop_string_start(prompt_tail, text, stop_strings)
    if start is not None:
        # the stop string ends before any EOS: keep tokens up to the one that completes it (binary search over
        # prefixes: "completes a stop string" only turns on as the prefix grows)
        lo, hi = 1, len(body)
        while lo < hi:
            mid = (lo + hi) // 2
            prefix = tokenizer.decode(body[:mid], skip_special_tokens=True)
            if _stop_string_start(prompt_tail, prefix, stop_strings) is not None:
                hi = mid
            else:
                lo = mid + 1
        return lo, True, text[: max(start, 0)]
    if eos_at is not None:
        return eos_at + 1, True, text
    # stopped on a stop string the decoded text does not show (e.g. one inside a special token's name): it ended
    return len(ids), stopped_after is not None, text


class _RecordStops(StoppingCriteria):
    """Wraps a stopping criterion and records, per row, how many tokens had been generated when it first fired
    (rows are padded after that)."""

    def __init__(self, criterion: StoppingCriteria, context_length: int):
        self.criterion, self.context_length = criterion, context_length
        self.stopped_after: list[int | None] | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        done = self.criterion(input_ids, scores, **kwargs)
        if self.stopped_after is None:
            self.stopped_after = [None] * input_ids.shape[0]
        generated = input_ids.shape[1] - self.context_length
        for row in done.nonzero().flatten().tolist():
            if self.stopped_after[row] is None:
                self.stopped_after[row] = generated
        return done


def _prompt_tails(
    tokenizer,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    stop_strings: Sequence[str],
) -> list[str]:
    """The last characters of each decoded prompt that a stop string completed by the response could begin in."""
    width = max((len(s) for s in stop_strings), default=1) - 1
    if width == 0:
        return [""] * input_ids.shape[0]
    return [
        tokenizer.decode(row[m.bool()].tolist(), skip_special_tokens=True)[-width:]
        for row, m in zip(input_ids.cpu(), attention_mask.cpu())
    ]


@contextlib.contextmanager
def _only_generation_config(model: nn.Module, gen_config: GenerationConfig):
    """Make `gen_config` the model's own generation config while it generates: transformers fills every field the
    call leaves unset (None) from the model's generation_config (min_p, suppress_tokens, repetition_penalty, ...),
    and any of those would change the sampling distribution away from softmax(logits / T) with top-k / top-p."""
    target = unwrap_peft(model)
    saved = target.generation_config
    target.generation_config = gen_config
    try:
        yield
    finally:
        target.generation_config = saved


@torch.no_grad()
def generate(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_strings: Sequence[str] = (),
    generator_seed: int | None = None,
    repetition_penalty: float = 1.0,
    return_logits: bool = False,
    return_hidden: bool = False,
    compute_dtype: torch.dtype = torch.float32,
    drop_finished: bool = False,
    draw: str = "inverse_cdf",
    kv_cache: KVCache = "preallocated",
    on_step: Callable[[int, int], None] | None = None,
) -> GenerationOutput:
    """Sample one response per prompt from logits / temperature, then top-k / top-p, with only the settings given
    here (the model's own generation processors would change the distribution PPO's ratios assume).
    `generator_seed`: reproducible, the global RNG untouched. return_logits / return_hidden keep the sampling pass's
    raw logits and last hidden states (PPO's old log-probs and values without a second forward pass).
    compute_dtype bf16: under autocast (fp32 on CPU: oneDNN-packed linear weights). drop_finished: ended rows leave
    the batch (`sample_dropping_finished`, with `draw`, `kv_cache`, `on_step`; not with return_logits / hidden)."""
    stop_strings = [s for s in stop_strings if s]
    eos_ids = stop_token_ids(tokenizer, model, stop_strings)  # before the model's generation_config is set aside
    gen_config = GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        repetition_penalty=repetition_penalty,  # 1.0: none; only evaluation may set it (PPO samples the full softmax)
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
        return_dict_in_generate=True,
        output_logits=return_logits,
        output_hidden_states=return_hidden,
    )
    stops = _RecordStops(StopStringCriteria(tokenizer, stop_strings), input_ids.shape[1]) if stop_strings else None
    out, gen_out = _sample_sequences(
        model,
        input_ids,
        attention_mask,
        gen_config,
        stops,
        eos_ids,
        generator_seed=generator_seed,
        compute_dtype=compute_dtype,
        drop_finished=drop_finished,
        draw=draw,
        kv_cache=kv_cache,
        on_step=on_step,
    )
    kept = gen_out if return_logits or return_hidden else None
    return _generation_output(tokenizer, input_ids, attention_mask, out, kept, stops, eos_ids, stop_strings)


def _sample_sequences(
    model, input_ids, attention_mask, gen_config: GenerationConfig, stops, eos_ids: list[int], **how
) -> tuple[torch.Tensor, Any]:
    """The prompt and response token ids of each row, sampled as `gen_config` says, and transformers' output (None
    when ended rows left the batch). `how`: generate's keyword arguments from generator_seed on."""
    was_training = model.training
    model.eval()
    cuda = [input_ids.device.index or 0] if input_ids.device.type == "cuda" else []
    # a private, seeded RNG stream leaves the global state as it was; without a seed, sample from the caller's RNG
    seed, mixed = how["generator_seed"], how["compute_dtype"] != torch.float32
    keep_pass = gen_config.output_logits or gen_config.output_hidden_states
    gen_out = None
    with (
        torch.random.fork_rng(devices=cuda, enabled=seed is not None),
        # the packed kernel is fp32 and eager only
        packed_linears(model, batch_size=input_ids.shape[0], enabled=not mixed and how["kv_cache"] != "compiled"),
        _only_generation_config(model, gen_config),
        autocast(input_ids.device, how["compute_dtype"]),
    ):
        if seed is not None:
            torch.manual_seed(seed)
        if how["drop_finished"] and not keep_pass:
            c = gen_config
            processors = logits_processors(
                temperature=c.temperature, top_k=c.top_k, top_p=c.top_p, repetition_penalty=c.repetition_penalty
            )
            out, stopped = sample_dropping_finished(
                model,
                input_ids,
                attention_mask,
                max_new_tokens=c.max_new_tokens,
                processors=processors,
                stop_ids=eos_ids,
                pad_id=c.pad_token_id,
                stop_criterion=stops.criterion if stops else None,
                draw=DRAWS[how["draw"]],
                kv_cache=how["kv_cache"],
                on_step=how["on_step"],
            )
            if stops:
                stops.stopped_after = stopped
        else:
            capacity = input_ids.shape[1] + gen_config.max_new_tokens
            if how["kv_cache"] == "compiled":  # transformers compiles the decode step for a StaticCache
                gen_config.compile_config = compile_config(input_ids.device)
            gen_out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=gen_config,
                stopping_criteria=StoppingCriteriaList([stops] if stops else []),
                past_key_values=new_kv_cache(how["kv_cache"], capacity, model.config),
            )
            out = gen_out.sequences
    model.train(was_training)
    return out, gen_out


def _generation_output(
    tokenizer, input_ids, attention_mask, out, gen_out, stops, eos_ids: list[int], stop_strings: list[str]
) -> GenerationOutput:
    """Each response cut after its end (EOS or stop string) and padded, its text, and what the sampling pass kept
    (`gen_out`: transformers' output when generate was asked for its logits or hidden states, else None)."""
    context_length = input_ids.shape[1]
    response = out[:, context_length:].clone()
    B, T = response.shape
    response_mask = torch.zeros_like(response)
    ended = torch.zeros(B, dtype=torch.bool)
    texts = []
    eos_set = set(eos_ids)
    tails = _prompt_tails(tokenizer, input_ids, attention_mask, stop_strings)
    stopped_after = (stops.stopped_after if stops is not None else None) or [None] * B
    for i, ids in enumerate(response.tolist()):
        keep, ended[i], text = _cut_response(
            tokenizer, ids, eos_set, stop_strings, prompt_tail=tails[i], stopped_after=stopped_after[i]
        )
        response_mask[i, :keep] = 1
        texts.append(text)
    response = response.masked_fill(response_mask == 0, tokenizer.pad_token_id)
    return_logits = gen_out is not None and gen_out.logits is not None
    return_hidden = gen_out is not None and gen_out.hidden_states is not None
    logits = torch.stack(gen_out.logits, dim=1) if return_logits else None
    # step 0 is the prompt's pass: its last position is the state the first response token was sampled from
    hidden = torch.cat([step[-1][:, -1:] for step in gen_out.hidden_states], dim=1) if return_hidden else None
    return GenerationOutput(
        query_response=torch.cat([input_ids, response], dim=1),
        response=response,
        response_mask=response_mask,
        ended=ended.to(out.device),
        texts=texts,
        attention_mask=torch.cat([attention_mask, response_mask], dim=1),
        logits=logits,
        hidden=hidden,
    )
