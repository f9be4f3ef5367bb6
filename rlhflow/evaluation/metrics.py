"""Evaluation metrics, each computed in exactly one place (definitions: docs/evaluation.md).

- perplexity of reference responses, teacher-forced after the chat-formatted prompt;
- KL(policy || reference): the k1 estimator summed over sampled response tokens, averaged over responses, in nats;
- win rate against the SFT answers (ties count half); intervals and the length-controlled win rate: stats.py;
- drift and reward hacking: length, distinct-n, repetition rate;
- reward-model calibration (accuracy by confidence bucket, expected calibration error) and Kendall's tau against
  the human ranking of a prompt's responses.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rlhflow.fsutil import save_for_file, saved_for_file
from rlhflow.models.logits import kl_per_token
from rlhflow.models.policy import pad_sequences, prompt_ids, sequence_logprobs

Messages = list[dict[str, str]]


def _batches_by_length(queries, answers, pad_token_id: int, batch_size: int, by_length: bool, device):
    """Rows (prompt ids, response ids) in batches of `batch_size`, in order of length (`by_length`; else as given), so
    that a batch pads little. Yields each batch's row indices, query_response, attention mask, context length and
    response mask.

    Each row is its prompt and response together, left-padded as one: a batch is as wide as its longest row, not as
    its longest prompt plus its longest response (1.37x the real tokens on the shipped held-out prompts and SFT
    answers, against 1.04x). Every response then ends in the last column, so the last `max response length`
    columns hold every row's response (after the end of its prompt for a shorter one): the context length is the
    width less that, and the response mask marks each row's own tokens in those columns."""
    order = list(range(len(answers)))
    if by_length:
        order.sort(key=lambda i: len(queries[i]) + len(answers[i]))
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        query_response, attention = pad_sequences(
            [list(queries[i]) + list(answers[i]) for i in rows], pad_token_id, side="left"
        )
        _, response_mask = pad_sequences([answers[i] for i in rows], pad_token_id, side="left")
        window = response_mask.shape[1]
        if query_response.shape[1] <= window:  # no prompt token before the first response: one pad column
            query_response = torch.nn.functional.pad(query_response, (1, 0), value=pad_token_id)
            attention = torch.nn.functional.pad(attention, (1, 0))
        context_length = query_response.shape[1] - window
        yield rows, query_response.to(device), attention.to(device), context_length, response_mask.to(device)


@torch.no_grad()
def response_nll(
    model,
    tokenizer,
    prompt_messages: list[Messages],
    responses: list[str],
    *,
    batch_size: int = 8,
    max_prompt_length: int = 256,
    max_response_length: int = 256,
    by_length: bool = True,
) -> tuple[float, int]:
    """Summed negative log-likelihood of `responses` given their prompts, and the token count. A response that fits
    in `max_response_length` tokens with its EOS is scored with it; a longer one is cut to `max_response_length`
    tokens without EOS (it does not end there).

    Rows are batched in order of length (`by_length`; else in the given order), so that a batch pads little: the
    cost follows the real tokens, not the longest row of each batch. Each row's sum is added in float64 in the
    given order, so the batching moves the result only by the rounding of each row's forward pass."""
    device = next(model.parameters()).device
    queries = [prompt_ids(tokenizer, messages, max_prompt_length) for messages in prompt_messages]
    answers = []
    for r in responses:
        ids = tokenizer(r, add_special_tokens=False)["input_ids"]
        answers.append(ids + [tokenizer.eos_token_id] if len(ids) < max_response_length else ids[:max_response_length])
    row_nll = [0.0] * len(answers)
    batches = _batches_by_length(queries, answers, tokenizer.pad_token_id, batch_size, by_length, device)
    for rows, query_response, attention, context_length, resp_mask in batches:
        logp = sequence_logprobs(model, query_response, attention, context_length, 1.0)
        for i, row_sum in zip(rows, (logp.double() * resp_mask).sum(dim=1).tolist()):
            row_nll[i] = -row_sum
    return sum(row_nll), sum(len(a) for a in answers)


def perplexity(model, tokenizer, prompt_messages: list[Messages], responses: list[str], **kwargs) -> float:
    nll, tokens = response_nll(model, tokenizer, prompt_messages, responses, **kwargs)
    return math.exp(nll / max(tokens, 1))


# The SFT model's perplexity, saved beside its weights by the sft stage: evaluate reads it rather than measure the
# same model on the same rows again. It names the rows it was measured on (the first `rows` prompts of the data file,
# by the file's md5), so a figure for other rows is never taken for this one.
HELD_OUT_PERPLEXITY_FILE = "held_out_perplexity.json"


def save_held_out_perplexity(model_dir, value: float, *, rows: int, data_file) -> None:
    save_for_file(Path(model_dir) / HELD_OUT_PERPLEXITY_FILE, {"perplexity": value, "rows": rows}, data_file=data_file)


def saved_held_out_perplexity(model_dir, *, rows: int, data_file) -> float | None:
    """The perplexity saved in `model_dir` for the first `rows` prompts of `data_file` as it is now; None when
    there is none for them."""
    record = saved_for_file(Path(model_dir) / HELD_OUT_PERPLEXITY_FILE, data_file=data_file, rows=rows)
    return None if record is None else float(record["perplexity"])


@torch.no_grad()
def response_kl(
    policy,
    reference,
    query_response: torch.Tensor,
    attention_mask: torch.Tensor,
    context_length: int,
    response_mask: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Summed per-token KL (k1) of policy to reference over each sampled response: tensor [B], in nats."""
    logp = sequence_logprobs(policy, query_response, attention_mask, context_length, temperature)
    ref_logp = sequence_logprobs(reference, query_response, attention_mask, context_length, temperature)
    return (kl_per_token(logp, ref_logp, "k1") * response_mask).sum(dim=1)


@torch.no_grad()
def sampled_kl(
    policy,
    reference,
    outputs,
    temperature: float,
    *,
    pad_token_id: int,
    batch_size: int = 8,
    by_length: bool = True,
    parts: Sequence[int] | None = None,
    lines=None,
) -> torch.Tensor:
    """`response_kl` of every response in `outputs` (GenerationOutputs, as sampled), float64 [N] in their order.
    The rows are taken out of their sampling batches and scored in batches of `batch_size` in order of length
    (`by_length`; else in the given order), so that a batch pads little. `parts`: the sizes of consecutive parts of
    the rows (held-out splits) scored apart, so that a part's figures do not depend on the others; None: one part.
    `lines`: a progress line writer (rlhflow.progress.ProgressLines), told how many answers are scored."""
    queries, answers = [], []
    for o in outputs:
        ctx = o.context_length
        for ids, mask, response, response_mask in zip(
            o.query_response[:, :ctx], o.attention_mask[:, :ctx], o.response, o.response_mask
        ):
            queries.append(ids[mask.bool()].tolist())
            answers.append(response[response_mask.bool()].tolist())
    device = next(policy.parameters()).device
    kl = torch.zeros(len(answers), dtype=torch.float64)
    start = scored = 0
    for size in [len(answers)] if parts is None else parts:
        part = slice(start, start + size)
        for rows, query_response, attention, context_length, response_mask in _batches_by_length(
            queries[part], answers[part], pad_token_id, batch_size, by_length, device
        ):
            kl[[start + i for i in rows]] = (
                response_kl(policy, reference, query_response, attention, context_length, response_mask, temperature)
                .double()
                .cpu()
            )
            scored += len(rows)
            if lines:
                lines(f"KL to the SFT model: {scored} of {len(answers)} answers scored")
        start += size
    if start != len(answers):
        raise ValueError(f"parts of {start} rows for {len(answers)} answers")
    return kl


def wins(policy_scores, baseline_scores) -> np.ndarray:
    """Per prompt: 1 where the policy's response scores higher, 0.5 on a tie, 0 else."""
    policy = torch.as_tensor(policy_scores, dtype=torch.float64)
    baseline = torch.as_tensor(baseline_scores, dtype=torch.float64)
    return ((policy > baseline).double() + 0.5 * (policy == baseline).double()).numpy()


def win_rate(policy_scores, baseline_scores) -> float:
    per_prompt = wins(policy_scores, baseline_scores)
    return float(per_prompt.mean()) if len(per_prompt) else math.nan


def distinct_n(texts: list[str], n: int) -> float:
    """Distinct n-grams / all n-grams over whitespace tokens of all texts (diversity; drops under mode collapse)."""
    grams = Counter()
    for text in texts:
        words = text.split()
        grams.update(tuple(words[j : j + n]) for j in range(len(words) - n + 1))
    total = sum(grams.values())
    return len(grams) / total if total else 0.0


def mean_length(texts: list[str]) -> float:
    """Mean response length in whitespace words (tokenizer-independent, so comparable across policies)."""
    return sum(len(t.split()) for t in texts) / len(texts) if texts else 0.0


def repetition_rate(texts: list[str], n: int = 4) -> float:
    """seq-rep-n (Welleck et al., 2019): per response, the fraction of its word n-grams that repeat an earlier
    n-gram of the same response (1 - distinct/total), averaged over responses that have an n-gram.
    A policy that loops ("and so on and so on ...") pushes it towards 1."""
    rates = []
    for text in texts:
        words = text.split()
        grams = [tuple(words[j : j + n]) for j in range(len(words) - n + 1)]
        if grams:
            rates.append(1.0 - len(set(grams)) / len(grams))
    return sum(rates) / len(rates) if rates else 0.0


# Confidence of a Bradley-Terry reward model in its own pairwise verdict: sigmoid(|margin|), in [0.5, 1].
CONFIDENCE_EDGES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


@dataclass(frozen=True)
class ConfidenceBucket:
    low: float
    high: float
    pairs: int
    confidence: float  # mean predicted probability that the higher-scored response is the preferred one
    accuracy: float  # observed fraction where it is (ties in score count half)

    @property
    def label(self) -> str:
        return f"{round(self.low * 100)}_{round(self.high * 100)}"


def confidence_buckets(
    margins: Sequence[float] | torch.Tensor, edges: Sequence[float] = CONFIDENCE_EDGES
) -> list[ConfidenceBucket]:
    """Bucket pairs by the reward model's confidence sigmoid(|r_chosen - r_rejected|) (raw, unnormalised scores:
    the Bradley-Terry probability) and measure, per bucket, how often the higher-scored response is the chosen
    one. A calibrated model has accuracy close to confidence in every bucket. Empty buckets are left out."""
    margins = torch.as_tensor(margins, dtype=torch.float64)
    confidence = torch.sigmoid(margins.abs())
    correct = (margins > 0).double() + 0.5 * (margins == 0).double()
    buckets = []
    for i, (low, high) in enumerate(zip(edges[:-1], edges[1:])):
        last = i == len(edges) - 2
        inside = (confidence >= low) & ((confidence <= high) if last else (confidence < high))
        if inside.any():
            buckets.append(
                ConfidenceBucket(
                    low, high, int(inside.sum()), float(confidence[inside].mean()), float(correct[inside].mean())
                )
            )
    return buckets


def expected_calibration_error(buckets: list[ConfidenceBucket]) -> float:
    """Sum over buckets of (share of pairs) * |accuracy - confidence|."""
    total = sum(b.pairs for b in buckets)
    return sum(b.pairs / total * abs(b.accuracy - b.confidence) for b in buckets) if total else math.nan


def ranking_from_pairs(pairs: Sequence[tuple[str, str]]) -> dict[str, int] | None:
    """A total order of a prompt's responses from its (preferred, dispreferred) pairs, as rank per response
    (0 = best), when the pairs determine exactly one (their transitive closure orders every two responses);
    None when they contradict each other or leave two responses unordered (e.g. chosen > a, chosen > b)."""
    beats: dict[str, set[str]] = defaultdict(set)
    responses: list[str] = []
    for winner, loser in pairs:
        beats[winner].add(loser)
        responses += [r for r in (winner, loser) if r not in responses]
    # Kahn's algorithm: a unique topological order exists iff exactly one response is unbeaten at every step.
    indegree = {r: 0 for r in responses}
    for winner in list(beats):
        for loser in beats[winner]:
            indegree[loser] += 1
    ranks: dict[str, int] = {}
    while len(ranks) < len(responses):
        top = [r for r in responses if r not in ranks and indegree[r] == 0]
        if len(top) != 1:
            return None  # a cycle (none unbeaten) or an unordered pair (several)
        ranks[top[0]] = len(ranks)
        for loser in beats[top[0]]:
            indegree[loser] -= 1
    return ranks


def kendall_tau(x: Sequence[float], y: Sequence[float]) -> float:
    """Kendall's tau-b between two score lists (+1: same order, -1: reversed; ties corrected)."""
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            dx, dy = x[i] - x[j], y[i] - y[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denominator = math.sqrt((concordant + discordant + ties_x) * (concordant + discordant + ties_y))
    return (concordant - discordant) / denominator if denominator else math.nan


def ranking_agreement(rows: Sequence[dict], scores: dict[tuple[str, str], float]) -> tuple[float, int]:
    """Mean Kendall's tau between reward-model scores and the human ranking, over the prompts whose pairs rank
    more than two responses in one total order (`ranking_from_pairs`); and the number of such prompts.
    `rows` have prompt/chosen/rejected; `scores` maps (prompt, response) to the reward-model score."""
    by_prompt: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for row in rows:
        by_prompt[row["prompt"]].append((row["chosen"], row["rejected"]))
    taus = []
    for prompt, pairs in by_prompt.items():
        ranks = ranking_from_pairs(pairs)
        if ranks is None or len(ranks) < 3:
            continue
        responses = list(ranks)
        # human: higher is better, like the scores
        taus.append(kendall_tau([-ranks[r] for r in responses], [scores[(prompt, r)] for r in responses]))
    return (sum(taus) / len(taus) if taus else math.nan), len(taus)
