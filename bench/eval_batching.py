"""Evaluation's forward passes batched in different ways, side by side: the held-out perplexity
(`rlhflow.evaluation.metrics.response_nll`) and the KL of sampled responses (`rlhflow.evaluation.metrics.sampled_kl`),
on the models and test split of a finished `make run` (params.yaml's paths), alternating, `--rounds` times each.

    .venv/bin/python -m bench.eval_batching [--rounds 2] [--set KEY=VALUE ...]   # given order against by length
    .venv/bin/python -m bench.eval_batching --layouts [--rounds 2]                # how a batch's rows are padded

How it measures: docs/benchmark-methods.md#eval_batching.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time

from rlhflow.config.params import add_overrides_argument, load_config

# A light door: torch, transformers and pandas are imported inside the functions that use them: --help is quick.


def padded_apart(queries, answers, pad_token_id: int, batch_size: int, by_length: bool, device):
    """The earlier layout of a scoring batch: prompts left-padded to the longest prompt, responses right-padded to
    the longest response, so a batch is as wide as the two maxima together."""
    import torch

    from rlhflow.models.policy import pad_sequences

    order = list(range(len(answers)))
    if by_length:
        order.sort(key=lambda i: len(queries[i]) + len(answers[i]))
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        query, query_mask = pad_sequences([queries[i] for i in rows], pad_token_id, side="left")
        response, response_mask = pad_sequences([answers[i] for i in rows], pad_token_id, side="right")
        query_response = torch.cat([query, response], dim=1).to(device)
        attention = torch.cat([query_mask, response_mask], dim=1).to(device)
        yield rows, query_response, attention, query.shape[1], response_mask.to(device)


@contextlib.contextmanager
def layout(name: str):
    """`as one`: the library's batches; `apart`: `padded_apart` in their place for the duration."""
    from rlhflow.evaluation import metrics

    own = metrics._batches_by_length
    if name == "apart":
        metrics._batches_by_length = padded_apart
    try:
        yield
    finally:
        metrics._batches_by_length = own


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layouts", action="store_true", help="compare how a batch's rows are padded")
    add_overrides_argument(parser, "params.yaml overrides (repeatable)")
    args = parser.parse_args(argv)

    from rlhflow.data.readers import read_jsonl
    from rlhflow.evaluation.held_out import as_precision
    from rlhflow.evaluation.metrics import response_nll, sampled_kl
    from rlhflow.models.loading import load_causal_lm, load_tokenizer, resolve_precision
    from tasks.evaluation_setup import evaluation_sampling

    cfg = load_config(overrides=args.overrides)
    e = cfg.evaluate
    sft_dir, policy_dir = str(cfg.path(cfg.sft.out_dir)), str(cfg.path(cfg.ppo.out_dir))
    tokenizer = load_tokenizer(sft_dir)
    sft = load_causal_lm(sft_dir, pad_token_id=tokenizer.pad_token_id).eval()
    policy = load_causal_lm(policy_dir, pad_token_id=tokenizer.pad_token_id).eval()
    if args.layouts:
        dtype = resolve_precision(e.precision, "cpu")
        sft, policy = as_precision(sft, dtype), as_precision(policy, dtype)
    test = read_jsonl(cfg.path(cfg.validate_.out_dir) / "test.jsonl").drop_duplicates("prompt")
    ref_rows = test.head(e.perplexity_rows)
    prompts, answers = list(ref_rows["prompt_messages"]), list(ref_rows["chosen"])
    outputs = evaluation_sampling(cfg).sample(policy, tokenizer, list(test.head(e.n_prompts)["prompt_messages"]))

    def perplexity(batch_size: int, by_length: bool) -> float:
        nll, tokens = response_nll(sft, tokenizer, prompts, answers, batch_size=batch_size, by_length=by_length)
        return math.exp(nll / tokens)

    def kl(batch_size: int, by_length: bool) -> float:
        per_response = sampled_kl(
            policy,
            sft,
            outputs,
            cfg.eval_temperature,
            pad_token_id=tokenizer.pad_token_id,
            batch_size=batch_size,
            by_length=by_length,
        )
        return float(per_response.mean())

    figures = (("SFT perplexity", perplexity), ("KL of the policy's samples", kl))
    if args.layouts:  # (figure, its function, batch size, by length, layout); the first of each figure is the base
        settings = [(n, fn, e.score_batch_size, True, lay) for n, fn in figures for lay in ("apart", "as one")]
    else:
        settings = [(n, fn, b, by, "as one") for n, fn in figures for b in (8, 16) for by in (False, True)]
    seconds: dict[tuple, list[float]] = {s[:1] + s[2:]: [] for s in settings}
    values: dict[tuple, float] = {}
    for _ in range(args.rounds):
        for name, fn, batch_size, by_length, padding in settings:
            with layout(padding):
                start = time.perf_counter()
                values[name, batch_size, by_length, padding] = fn(batch_size, by_length)
                seconds[name, batch_size, by_length, padding].append(time.perf_counter() - start)

    print(f"\n| figure | batch | rows batched | rows padded | seconds (median of {args.rounds}) | ratio | value |")
    print("|---|---:|---|---|---:|---:|---:|")
    for key, times in seconds.items():
        name, batch_size, by_length, padding = key
        base = (name, batch_size, True, "apart") if args.layouts else (name, batch_size, False, "as one")
        median = statistics.median(times)
        order = "by length" if by_length else "in the given order"
        ratio = median / statistics.median(seconds[base])
        print(f"| {name} | {batch_size} | {order} | {padding} | {median:.1f} | {ratio:.2f} | {values[key]!r} |")


if __name__ == "__main__":
    main()
