"""Generation and log-probabilities for causal LMs, shared by PPO and the evaluation stage.

- `encode_prompts`: chat messages -> left-padded prompt ids (chat template with the generation prompt).
- `generate`: batched sampling with a KV cache; responses cut after the first EOS or stop string and
  right-padded with the pad id; `ended` says which rows finished by themselves.
- `sequence_logprobs`: per-token log-probs (and entropy) of the response tokens under logits / temperature,
  with position ids that account for left padding. PPO's policy, old policy and reference, and the
  evaluation's KL and perplexity, all go through this one function.
- Value models: `ValueHead` on the policy's last hidden state (`value_model="shared"`: one forward gives
  logits and values) or a `Critic` (its own copy of the backbone plus a head, `value_model="separate"`),
  both behind `PolicyAndValue.forward`.

Precision: `compute_dtype` bf16 runs the transformers' forward passes under autocast (fp32 weights, bf16 matmuls);
log-probabilities, entropies and values are always computed in fp32, from upcast logits and hidden states.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedTokenizerBase
from transformers.generation import StoppingCriteria, StoppingCriteriaList, StopStringCriteria

from rlhflow.cpu_packed_linear import packed_linears
from rlhflow.decoding import DRAWS, logits_processors, sample_dropping_finished
from rlhflow.logits import entropy_from_logits, logprobs_from_logits
from rlhflow.models import autocast, unwrap_peft

Messages = list[dict]

# ---- prompts -------------------------------------------------------------------------------------


def prompt_text(tokenizer: PreTrainedTokenizerBase, messages: Messages | str) -> tuple[str, bool]:
    """The prompt as text, and whether the tokenizer should add its special tokens (BOS) to it."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return text, False  # the template already holds the special tokens it wants
    if len(messages) == 1:
        return messages[0]["content"], True
    turns = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(turns) + "\n\nAssistant:", True


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: Messages | str, max_prompt_length: int) -> list[int]:
    """The prompt's token ids as the policy is prompted (`prompt_text`), its last `max_prompt_length` of them: PPO's
    rollouts, evaluation and SFT's training sequences cut prompts alike."""
    text, add_special = prompt_text(tokenizer, messages)
    ids = tokenizer(text, add_special_tokens=add_special)["input_ids"]
    return list(ids[-max_prompt_length:])  # truncate from the left: the end of the prompt matters most


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompt_messages: Sequence[Messages | str], max_prompt_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize prompts (chat template + generation prompt when the tokenizer has one, plain text otherwise),
    keep the last `max_prompt_length` tokens of each, left-pad to the longest. Returns (input_ids, attention_mask)."""
    rows = [prompt_ids(tokenizer, messages, max_prompt_length) for messages in prompt_messages]
    return pad_sequences(rows, tokenizer.pad_token_id, side="left")


def pad_sequences(rows: Sequence[Sequence[int]], pad_id: int, *, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token lists into (ids, attention_mask), padded on the `side` ("left" for prompts that generation
    continues, "right" for responses)."""
    width = max(1, max((len(r) for r in rows), default=0))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            cols = slice(width - len(row), width) if side == "left" else slice(0, len(row))
            ids[i, cols] = torch.tensor(list(row), dtype=torch.long)
            mask[i, cols] = 1
    return ids, mask


# ---- generation ----------------------------------------------------------------------------------


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
) -> GenerationOutput:
    """Sample one response per prompt (do_sample, KV cache) from logits / temperature, then top-k / top-p.

    A response ends at the first EOS (any of `eos_token_ids`: the tokenizer's and those the model's generation_config
    lists), stop string that is a single vocabulary token, or token that completes a stop string; that token is
    kept as the last real token (it carries the score) and everything after it becomes pad. A stop string counts
    when it ends inside the response, also one that the prompt begins (transformers stops such a row too); never
    one wholly inside the prompt. `texts` are decoded without special tokens and cut before the stop string.
    Sampling uses only the settings given here, never the rest of the model's own generation_config (its
    processors would change the distribution PPO's ratios assume).
    `generator_seed` makes the sampling reproducible without touching the global RNG.
    return_logits / return_hidden keep the sampling pass's raw logits and last hidden states (PPO's old
    log-probs and shared-head values without a second forward pass). compute_dtype bf16: sampling under autocast.
    drop_finished: ended rows leave the batch (`rlhflow.decoding`; not with return_logits / return_hidden), each
    token drawn by `draw` (a name in `rlhflow.decoding.DRAWS`).
    On CPU in float32 the linear layers run on oneDNN-packed weights while sampling (`rlhflow.cpu_packed_linear`)."""
    stop_strings = [s for s in stop_strings if s]
    eos_ids = stop_token_ids(tokenizer, model, stop_strings)  # before the model's generation_config is set aside
    # only what we set: the model's own generation defaults must not change the sampling distribution
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
    context_length = input_ids.shape[1]
    stops = _RecordStops(StopStringCriteria(tokenizer, stop_strings), context_length) if stop_strings else None
    was_training = model.training
    model.eval()
    cuda = [input_ids.device.index or 0] if input_ids.device.type == "cuda" else []
    # a private, seeded RNG stream leaves the global state as it was; without a seed, sample from the caller's RNG
    mixed = compute_dtype != torch.float32
    with (
        torch.random.fork_rng(devices=cuda, enabled=generator_seed is not None),
        packed_linears(model, batch_size=input_ids.shape[0], enabled=not mixed),  # the packed kernel is fp32 only
        _only_generation_config(model, gen_config),
        autocast(input_ids.device, compute_dtype),
    ):
        if generator_seed is not None:
            torch.manual_seed(generator_seed)
        if drop_finished and not (return_logits or return_hidden):
            processors = logits_processors(
                temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty
            )
            out, stopped = sample_dropping_finished(
                model,
                input_ids,
                attention_mask,
                max_new_tokens=max_new_tokens,
                processors=processors,
                stop_ids=eos_ids,
                pad_id=tokenizer.pad_token_id,
                stop_criterion=stops.criterion if stops else None,
                draw=DRAWS[draw],
            )
            if stops:
                stops.stopped_after = stopped
        else:
            gen_out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=gen_config,
                stopping_criteria=StoppingCriteriaList([stops] if stops else []),
            )
            out = gen_out.sequences
    model.train(was_training)

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
    query_response = torch.cat([input_ids, response], dim=1)
    logits = torch.stack(gen_out.logits, dim=1) if return_logits else None
    # step 0 is the prompt's pass: its last position is the state the first response token was sampled from
    hidden = torch.cat([step[-1][:, -1:] for step in gen_out.hidden_states], dim=1) if return_hidden else None
    return GenerationOutput(
        query_response=query_response,
        response=response,
        response_mask=response_mask,
        ended=ended.to(out.device),
        texts=texts,
        attention_mask=torch.cat([attention_mask, response_mask], dim=1),
        logits=logits,
        hidden=hidden,
    )


# ---- log-probabilities ---------------------------------------------------------------------------


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that start at 0 on the first real token of each left-padded row."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def response_forward(
    model: nn.Module,
    query_response: torch.Tensor,
    attention_mask: torch.Tensor,
    context_length: int,
    *,
    output_hidden: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward pass; returns the logits that predict each response token [B, T, V] and, when asked, the
    last hidden state at the same positions [B, T, H] (the state s_t from which token t is sampled).
    Only the last T+1 positions go through the LM head (`logits_to_keep`)."""
    T = query_response.shape[1] - context_length
    kwargs = dict(
        input_ids=query_response,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    if output_hidden:
        kwargs["output_hidden_states"] = True
    try:
        out = model(**kwargs, logits_to_keep=T + 1)
    except TypeError:  # a model without `logits_to_keep`
        out = model(**kwargs)
    logits = out.logits[:, -(T + 1) : -1]
    hidden = out.hidden_states[-1][:, context_length - 1 : -1] if output_hidden else None
    return logits, hidden


def logprobs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    return_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(token | s_t) under logits / temperature [B, T] and, when asked, the entropy of that distribution."""
    logits = logits.float() / temperature
    logprobs = logprobs_from_logits(logits, tokens)
    return logprobs, (entropy_from_logits(logits) if return_entropy else None)


def sequence_logprobs(
    model: nn.Module,
    query_response: torch.Tensor,
    attention_mask: torch.Tensor,
    context_length: int,
    temperature: float = 1.0,
    *,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
):
    """Log-probs [B, T] of the response tokens (query_response[:, context_length:]) under logits / temperature;
    with return_entropy also the per-token entropy [B, T]. Padding positions are 0. chunk_size bounds the
    number of rows per forward pass (memory) without changing the result. compute_dtype bf16: the forward pass
    under autocast, the log-probs in fp32 from the upcast logits."""
    B = query_response.shape[0]
    step = chunk_size or B
    logprobs, entropies = [], []
    for start in range(0, B, step):
        qr, am = query_response[start : start + step], attention_mask[start : start + step]
        with autocast(qr.device, compute_dtype):
            logits, _ = response_forward(model, qr, am, context_length)
        lp, ent = logprobs_and_entropy(logits, qr[:, context_length:], temperature, return_entropy)
        logprobs.append(lp)
        entropies.append(ent)
    mask = attention_mask[:, context_length:].bool()
    logprobs = torch.cat(logprobs).masked_fill(~mask, 0.0)
    if not return_entropy:
        return logprobs
    return logprobs, torch.cat(entropies).masked_fill(~mask, 0.0)


# ---- value models --------------------------------------------------------------------------------


def hidden_size_of(model: nn.Module) -> int:
    config = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return int(config.hidden_size)


class ValueHead(nn.Module):
    """V(s_t) = w . h_t + b. Initialised small (std `init_std`, 0 by default) so that at the start the value
    loss sends no gradient into a shared backbone and values begin at 0."""

    def __init__(self, hidden_size: int, init_std: float = 0.0):
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.summary.weight, std=init_std) if init_std > 0 else nn.init.zeros_(self.summary.weight)
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # in the weights' dtype (fp32) even inside autocast: values enter the value loss and GAE
        with torch.autocast(hidden.device.type, enabled=False):
            return self.summary(hidden.to(self.summary.weight.dtype)).squeeze(-1)


def policy_backbone(policy: nn.Module) -> nn.Module:
    """The transformer body of a causal LM (without the LM head), unwrapping a peft model."""
    return unwrap_peft(policy).get_decoder()


class Critic(nn.Module):
    """A separate value model: its own backbone plus a value head. From the policy (a copy of the SFT backbone, a
    zero head) or from the reward model (a copy of its backbone and score head, the usual RLHF critic init)."""

    def __init__(self, backbone: nn.Module, hidden_size: int, init_std: float = 0.0):
        super().__init__()
        self.backbone = backbone
        self.head = ValueHead(hidden_size, init_std)

    @classmethod
    def from_policy(cls, policy: nn.Module, init_std: float = 0.0) -> Critic:
        return cls(copy.deepcopy(policy_backbone(policy)), hidden_size_of(policy), init_std)

    @classmethod
    def from_reward_model(cls, reward_model: nn.Module, mean: float = 0.0, std: float = 1.0) -> Critic:
        """A copy of a sequence-classification reward model (one label, a linear score head on every token's hidden
        state, as Llama-style `*ForSequenceClassification` models have) as critic: V(s_t) starts as the reward
        model's normalised score (score - mean) / std read at token t, the scale of the rewards PPO optimises."""
        score = getattr(reward_model, "score", None)
        if not isinstance(score, nn.Linear) or score.out_features != 1:
            raise ValueError(
                f"{type(reward_model).__name__} has no per-token linear score head (`score`, 1 label): "
                "it cannot initialise a token-level critic"
            )
        critic = cls(copy.deepcopy(reward_model.base_model).float(), score.in_features)  # fp32 master weights
        with torch.no_grad():
            critic.head.summary.weight.copy_(score.weight / std)
            bias = score.bias if score.bias is not None else torch.zeros(1)
            critic.head.summary.bias.copy_((bias - mean) / std)
        return critic

    def forward(
        self,
        query_response: torch.Tensor,
        attention_mask: torch.Tensor,
        context_length: int,
        compute_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """V(s_t) [B, T] for the response tokens; the backbone under autocast to `compute_dtype`, the head in fp32."""
        with autocast(query_response.device, compute_dtype):
            out = self.backbone(
                input_ids=query_response,
                attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask),
                use_cache=False,
            )
        return self.head(out.last_hidden_state[:, context_length - 1 : -1])


class PolicyAndValue(nn.Module):
    """The trainable pair. shared: the value head reads the policy's last hidden state (one forward pass; with
    `detach_value_input` no value-loss gradient reaches the backbone); separate: a `Critic` with its own backbone
    (a second forward pass). compute_dtype bf16: the transformers run
    under autocast (their fp32 weights are the master copy); log-probs, entropy and values come out in fp32."""

    def __init__(
        self,
        policy: nn.Module,
        value_model: str = "shared",
        critic: Critic | None = None,
        compute_dtype: torch.dtype = torch.float32,
        detach_value_input: bool = False,
    ):
        super().__init__()
        if value_model not in ("shared", "separate"):
            raise ValueError(f"value_model must be 'shared' or 'separate', got {value_model!r}")
        self.policy = policy
        self.value_model = value_model
        self.compute_dtype = compute_dtype
        self.detach_value_input = detach_value_input  # shared head: the value loss trains the head alone
        if value_model == "shared":
            self.value_head = ValueHead(hidden_size_of(policy))
        else:
            self.critic = critic if critic is not None else Critic.from_policy(policy)

    def value_module(self) -> nn.Module:
        return self.value_head if self.value_model == "shared" else self.critic

    def forward(
        self,
        query_response: torch.Tensor,
        attention_mask: torch.Tensor,
        context_length: int,
        temperature: float,
        *,
        return_entropy: bool = False,
    ):
        """(logprobs [B,T], values [B,T], entropy [B,T] or None) for the response tokens; padding is 0."""
        tokens = query_response[:, context_length:]
        shared = self.value_model == "shared"
        with autocast(query_response.device, self.compute_dtype):
            logits, hidden = response_forward(
                self.policy, query_response, attention_mask, context_length, output_hidden=shared
            )
        # fp32 from here: log pi and H[pi] from the upcast logits, V from the fp32 head
        if shared:
            values = self.value_head(hidden.detach() if self.detach_value_input else hidden)
        else:
            values = self.critic_values(query_response, attention_mask, context_length)
        logprobs, entropy = logprobs_and_entropy(logits, tokens, temperature, return_entropy)
        return _zero_padding(attention_mask[:, context_length:], logprobs, values, entropy)

    def critic_values(
        self, query_response: torch.Tensor, attention_mask: torch.Tensor, context_length: int
    ) -> torch.Tensor:
        """The separate critic's V(s_t) [B, T] (value_model="separate")."""
        return self.critic(query_response, attention_mask, context_length, self.compute_dtype)

    @torch.no_grad()
    def from_generation(self, gen: GenerationOutput, temperature: float, values: torch.Tensor | None = None):
        """What `forward(gen.query_response, ..., return_entropy=True)` returns, from the sampling pass instead of
        a second policy forward pass: log-probs and entropy from `gen.logits`, shared-head values from `gen.hidden`
        (a separate critic's `values` [B, T] are passed in). Equal up to rounding: KV-cache decoding and a full
        forward pass add in different orders."""
        if gen.logits is None:
            raise ValueError("generate(..., return_logits=True) keeps the logits this needs")
        logprobs, entropy = logprobs_and_entropy(gen.logits, gen.response, temperature, return_entropy=True)
        if values is None:
            if self.value_model != "shared" or gen.hidden is None:
                raise ValueError("values come from gen.hidden (shared head, return_hidden=True) or are passed in")
            values = self.value_head(gen.hidden)
        return _zero_padding(gen.response_mask, logprobs, values, entropy)


def _zero_padding(mask: torch.Tensor, logprobs: torch.Tensor, values: torch.Tensor, entropy: torch.Tensor | None):
    """(logprobs, values as float32, entropy) with 0 wherever `mask` [B, T] is 0."""
    pad = ~mask.bool()
    return (
        logprobs.masked_fill(pad, 0.0),
        values.float().masked_fill(pad, 0.0),
        None if entropy is None else entropy.masked_fill(pad, 0.0),
    )
