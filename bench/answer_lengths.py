"""How long the models' answers are, and how many never end: the measurement behind `evaluate.max_new_tokens` and the
evaluation's sampling settings (docs/evaluation.md).

    python -m bench.answer_lengths --model sft=models/sft --model policy=models/policy --prompts 48 \\
        --variant top_p=0.9 --variant repetition_penalty=1.2
    python -m bench.answer_lengths --model sft=models/sft --prompts 96 --max-new-tokens 256 --limits 256 \\
        --variant draw=multinomial          # the decoder's draw: its time against generate's own draw

How it measures: docs/benchmark-methods.md#answer_lengths.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from rlhflow.config.params import load_config

# A light door: torch, transformers and the evaluation's modules are imported in main(), so --help answers at once.


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, help="name=model_dir (repeatable)")
    parser.add_argument("--test-file", default="data/validated/test.jsonl")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--limits", default="48,128,192,256,384,512")
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="key=value of the sampling settings (temperature, top_p, repetition_penalty; decoder=generate: "
        "transformers' generate; draw=multinomial: the decoder with generate's draw), applied to the first model "
        "only, beside its default settings (repeatable)",
    )
    parser.add_argument("--json", default="bench/.work/answer_lengths.json")
    parser.add_argument("--set", action="append", default=[], help="params.yaml override, as for the pipeline")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from rlhflow.evaluation.answers import Answers, ended_within
    from rlhflow.evaluation.held_out import evaluation_prompts
    from rlhflow.models.loading import load_causal_lm, load_tokenizer
    from tasks.evaluation_setup import evaluation_sampling

    cfg = load_config(overrides=args.set)
    base = dataclasses.replace(evaluation_sampling(cfg), max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    prompts = evaluation_prompts(Path(args.test_file), args.prompts)["prompt_messages"].tolist()
    limits = [int(x) for x in args.limits.split(",")]
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32

    runs = [(name, path, base, "default") for name, path in (m.split("=", 1) for m in args.model)]
    first_name, first_path = runs[0][:2]
    for variant in args.variant:
        key, value = variant.split("=", 1)
        setting = value if key in ("decoder", "draw") else float(value)
        runs.append((first_name, first_path, dataclasses.replace(base, **{key: setting}), variant))

    rows = []
    for name, path, settings, label in runs:
        tokenizer = load_tokenizer(path)
        model = load_causal_lm(path, pad_token_id=tokenizer.pad_token_id).to(dtype).eval()
        start = time.perf_counter()
        answers = Answers.from_outputs(settings.sample(model, tokenizer, prompts), cfg.evaluate.degenerate_repetition)
        seconds = time.perf_counter() - start
        row = {"model": name, "sampling": label, "answers": len(answers), "seconds": round(seconds, 1)}
        row.update({f"ended<={limit}": ended_within(answers.tokens, answers.ended, limit) for limit in limits})
        row.update({f"{k}@{args.max_new_tokens}": v for k, v in answers.shares().items()})
        row["tokens_median"] = float(torch.tensor(answers.tokens, dtype=torch.float).median())
        # the cost of a setting is per token: settings whose answers differ in length also differ in tokens
        row["tokens_total"] = int(sum(answers.tokens))
        row["tokens_per_s"] = round(row["tokens_total"] / seconds, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)

    print(
        f"\n{len(prompts)} held-out prompts, temperature {base.temperature}, top-p {base.top_p}, repetition penalty "
        f"{base.repetition_penalty}, {args.precision} weights, up to {args.max_new_tokens} new tokens\n"
    )
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
