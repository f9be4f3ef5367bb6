"""Sampling that drops finished rows from the batch: the evaluation's decoder (docs/evaluation.md, benchmarks.md).

`model.generate` carries every row until the last one ends, and a CPU decode step's cost grows with its rows, so one
looping answer keeps a batch of 48 at full size. `sample_dropping_finished` samples from `generate`'s distribution
(repetition penalty, temperature, top-k, top-p, in that order) and drops ended rows from the batch and the KV cache
once they are a quarter of it. Each token is drawn by inverting its row's CDF at one uniform number
(`inverse_cdf_draw`, 0.7 ms for 48 x 49,152 against `torch.multinomial`'s 47 ms): the same distribution
(tests/test_decoding.py), other tokens than `generate` at the same seed, the same tokens when greedy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.generation import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rlhflow.models.kv_cache import KVCache, new_kv_cache

# evict ended rows once they are this share of the rows in the batch: each eviction copies the KV cache once
EVICT_SHARE = 0.25
# tokens per block of inverse_cdf_draw's first step (49,152 = 192 blocks of 256)
CDF_BLOCK = 256


def logits_processors(
    *, temperature: float, top_k: int, top_p: float, repetition_penalty: float
) -> LogitsProcessorList:
    """The processors `model.generate` builds for these settings, in its order: the penalty, then the warpers."""
    processors = LogitsProcessorList()
    if repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    return processors


def inverse_cdf_draw(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [B, V] (rows summing to 1, or to any positive total): the token whose cumulative
    probability first exceeds u * total, for u ~ U[0, 1) from the global random stream.

    In two steps, so that no pass but one sum touches all V entries: the block of CDF_BLOCK tokens the draw falls
    in (from the blocks' masses), then the token inside that block (from its entries). Sums run in float64. A
    token of probability 0 is never drawn: its cumulative sum equals the one before it, and a rounding at the end
    of a row or block falls back to its last token of positive mass."""
    B, V = probs.shape
    pad = (-V) % CDF_BLOCK
    blocks = torch.nn.functional.pad(probs, (0, pad)).view(B, -1, CDF_BLOCK)
    block_cdf = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # [B, V / CDF_BLOCK]
    u = torch.rand(B, 1, dtype=torch.float64, device=probs.device) * block_cdf[:, -1:]
    block = _first_above(block_cdf, u)  # [B, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inner_cdf = blocks.gather(1, block[..., None].expand(B, 1, CDF_BLOCK)).squeeze(1).double().cumsum(dim=-1)
    token = _first_above(inner_cdf, u - before)
    return (block * CDF_BLOCK + token).squeeze(1)


def _first_above(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative sum exceeds u, and at most the row's last index of positive mass
    (the number of entries whose sum is still below the row's total)."""
    last = (cdf < cdf[:, -1:]).sum(dim=-1, keepdim=True)
    return torch.minimum(torch.searchsorted(cdf, u, right=True), last)


def multinomial_draw(probs: torch.Tensor) -> torch.Tensor:
    """One token per row as `model.generate` draws it (`torch.multinomial`): the same distribution, slower."""
    return torch.multinomial(probs, num_samples=1).squeeze(1)


# the draws a caller may name (rlhflow.models.sampling.Sampling.draw): one token per row from the processed
# probabilities
DRAWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "inverse_cdf": inverse_cdf_draw,
    "multinomial": multinomial_draw,
}


def _prefill(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: Cache):
    """The prompts' forward pass, filling `cache`; the LM head on the last position only where the model can."""
    positions = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    prefill = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
    )
    try:
        return model(**prefill, logits_to_keep=1)
    except TypeError:  # a model without `logits_to_keep`
        return model(**prefill)


@torch.no_grad()
def sample_dropping_finished(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    processors: LogitsProcessorList,
    stop_ids: Sequence[int],
    pad_id: int,
    stop_criterion: StoppingCriteria | None = None,
    draw: Callable[[torch.Tensor], torch.Tensor] = inverse_cdf_draw,
    kv_cache: KVCache = "preallocated",
) -> tuple[torch.Tensor, list[int | None]]:
    """Sample up to `max_new_tokens` tokens after each left-padded prompt.

    Returns (sequences [B, P+T]: the prompts and the sampled tokens, `pad_id` after a row's end, T the longest
    row's length; like `generate(...).sequences`) and, per row, the number of tokens generated when
    `stop_criterion` (e.g. transformers' StopStringCriteria) stopped it, or None. A row ends on a token of
    `stop_ids` (kept) or when `stop_criterion` fires. `draw` picks one token per row from the processed
    probabilities (`multinomial_draw`: generate's own draws); `kv_cache` names the cache (rlhflow.models.kv_cache)."""
    B, P = input_ids.shape
    device = input_ids.device
    stop_ids_t = torch.tensor(list(stop_ids), device=device, dtype=torch.long)
    sampled = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    stopped_after: list[int | None] = [None] * B
    rows = torch.arange(B, device=device)  # each batch row's index in the caller's batch
    done = torch.zeros(B, dtype=torch.bool, device=device)
    seq, mask = input_ids, attention_mask
    cache = new_kv_cache(kv_cache, P + max_new_tokens)
    out = _prefill(model, seq, mask, cache)
    generated = 0
    for step in range(max_new_tokens):
        scores = processors(seq, out.logits[:, -1, :].float())
        token = draw(torch.softmax(scores, dim=-1))
        token = token.masked_fill(done, pad_id)
        sampled[rows, step] = token
        generated = step + 1
        seq = torch.cat([seq, token[:, None]], dim=1)
        mask = torch.cat([mask, (~done).long()[:, None]], dim=1)
        ended = torch.isin(token, stop_ids_t) & ~done
        if stop_criterion is not None:
            stopped = stop_criterion(seq, scores).to(device) & ~done & ~ended
            for i in stopped.nonzero().flatten().tolist():
                stopped_after[int(rows[i])] = step + 1
            ended |= stopped
        done |= ended
        if bool(done.all()) or step + 1 == max_new_tokens:
            break
        if int(done.sum()) >= EVICT_SHARE * len(done):
            keep = (~done).nonzero().flatten()
            cache.batch_select_indices(keep)
            seq, mask, rows, done = seq[keep], mask[keep], rows[keep], done[keep]
        positions = mask.long().sum(dim=1, keepdim=True) - 1
        out = model(
            input_ids=seq[:, -1:], attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
        )
    return torch.cat([input_ids, sampled[:, :generated]], dim=1), stopped_after
