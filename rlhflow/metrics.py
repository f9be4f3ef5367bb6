"""Evaluation metrics, each computed in exactly one place.

- perplexity of reference responses: exp(sum of token NLLs / number of response tokens), teacher-forced
  after the chat-formatted prompt (temperature 1);
- KL(policy || reference) per response: sum over the sampled response tokens of log pi(a_t) - log pi_ref(a_t)
  (the k1 estimator, unbiased under samples from the policy), averaged over responses, in nats;
- win rate: fraction of prompts where the policy's response outscores the SFT response (ties count half);
- pairwise accuracy (in rlhflow.reward): fraction of pairs where chosen outscores rejected.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from rlhflow.policy import encode_prompts, pad_sequences, sequence_logprobs
from rlhflow.ppo.core import kl_per_token

Messages = list[dict[str, str]]


@torch.no_grad()
def response_nll(model, tokenizer, prompt_messages: list[Messages], responses: list[str], *, batch_size: int = 8,
                 max_prompt_length: int = 256, max_response_length: int = 256) -> tuple[float, int]:
    """Summed negative log-likelihood of `responses` (each ended by EOS) given their prompts, and the token count."""
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    for i in range(0, len(responses), batch_size):
        query, query_mask = encode_prompts(tokenizer, prompt_messages[i : i + batch_size], max_prompt_length)
        resp_ids = [tokenizer(r, add_special_tokens=False)["input_ids"][: max_response_length - 1] + [tokenizer.eos_token_id]
                    for r in responses[i : i + batch_size]]
        resp, resp_mask = pad_sequences(resp_ids, tokenizer.pad_token_id, side="right")
        query_response = torch.cat([query, resp], dim=1).to(device)
        attention = torch.cat([query_mask, resp_mask], dim=1).to(device)
        logp = sequence_logprobs(model, query_response, attention, query.shape[1], 1.0)
        total_nll -= float((logp * resp_mask.to(device)).sum())
        total_tokens += int(resp_mask.sum())
    return total_nll, total_tokens


def perplexity(model, tokenizer, prompt_messages: list[Messages], responses: list[str], **kwargs) -> float:
    nll, tokens = response_nll(model, tokenizer, prompt_messages, responses, **kwargs)
    return math.exp(nll / max(tokens, 1))


@torch.no_grad()
def response_kl(policy, reference, query_response: torch.Tensor, attention_mask: torch.Tensor, context_length: int,
                response_mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """Summed per-token KL (k1) of policy to reference over each sampled response: tensor [B], in nats."""
    logp = sequence_logprobs(policy, query_response, attention_mask, context_length, temperature)
    ref_logp = sequence_logprobs(reference, query_response, attention_mask, context_length, temperature)
    return (kl_per_token(logp, ref_logp, "k1") * response_mask).sum(dim=1)


def win_rate(policy_scores: torch.Tensor, baseline_scores: torch.Tensor) -> float:
    wins = (policy_scores > baseline_scores).float() + 0.5 * (policy_scores == baseline_scores).float()
    return float(wins.mean())


def distinct_n(texts: list[str], n: int) -> float:
    """Distinct n-grams / all n-grams over whitespace tokens of all texts (diversity; drops under mode collapse)."""
    grams = Counter()
    for text in texts:
        words = text.split()
        grams.update(tuple(words[j : j + n]) for j in range(len(words) - n + 1))
    total = sum(grams.values())
    return len(grams) / total if total else 0.0
