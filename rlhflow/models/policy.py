"""The policy's side of a causal LM, shared by PPO and the evaluation stage: prompts as token ids (`encode_prompts`,
the chat template with the generation prompt, left-padded), per-token log-probs and entropy of responses
(`sequence_logprobs`, the one function PPO's policy, old policy and reference and the evaluation's KL and perplexity
all go through), and the value models: a `ValueHead` on the policy's last hidden state or a `Critic` of its own,
both behind `PolicyAndValue`. Sampling is rlhflow.models.generation; precision: docs/ppo.md."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from rlhflow.models.generation import GenerationOutput
from rlhflow.models.loading import autocast, unwrap_peft
from rlhflow.models.logits import entropy_from_logits, logprobs_from_logits

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
