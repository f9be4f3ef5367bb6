"""Reward-model recipes on the pipeline's validated splits: chosen by dev accuracy, reported on the test split.

    .venv/bin/python -m bench.reward_model_recipes '{"learning_rate": 1e-4, "epochs": 1}' \\
        '{"learning_rate": 5e-5, "epochs": 2, "pooling": "mean"}' '{"data": "all", "prompt": "last_turn"}'

How it measures: docs/benchmark-methods.md#reward_model_recipes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from rlhflow.config.params import DEFAULT_ENCODER, RewardModelConfig, load_config

# A light door: torch, transformers and pandas (training, scoring, reading the splits) are imported where they are used.

PROMPT_VIEWS = {
    "dialogue": lambda messages: messages,
    "last_turn": lambda messages: [m for m in messages if m["role"] == "user"][-1:],
    "none": lambda messages: [],
}


def validated_splits() -> dict[str, list[dict]]:
    from rlhflow.data.readers import read_jsonl

    cfg = load_config()
    validated = cfg.path(cfg.validate_.out_dir)
    splits = {}
    for split in ("train", "judge", "dev", "test"):
        path = validated / f"{split}.jsonl"
        if not path.exists():
            hint = "set validate.dev_fraction above 0, then " if split == "dev" else ""
            raise SystemExit(f"{path} is missing: {hint}run `dvc repro validate` (or `make run`) first")
        splits[split] = read_jsonl(path).to_dict("records")
    return splits


def choose(results: list[dict]) -> dict:
    """The recipe with the best dev accuracy; the earlier one on a tie (`max` keeps the first). Reads nothing of the
    test split."""
    return max(results, key=lambda r: r["dev"]["accuracy"])


def _viewed(rows: list[dict], view) -> list[dict]:
    return [{**r, "prompt_messages": view(r["prompt_messages"])} for r in rows]


def _accuracy(metrics: dict) -> str:
    return f"{metrics['accuracy']:.3f} +- {metrics['accuracy_se']:.3f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="+", help="JSON: reward_model params, data, prompt, backbone, seed")
    args = parser.parse_args(argv)
    from rlhflow.evaluation.pairs import evaluate_pairs
    from rlhflow.training.reward_model import train_reward_model

    splits = validated_splits()
    data = {"proxy": splits["train"], "all": splits["train"] + splits["judge"]}
    print(
        f"pairs: proxy {len(data['proxy'])}, all {len(data['all'])}, dev {len(splits['dev'])}, "
        f"test {len(splits['test'])}",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory() as models:
        for index, spec in enumerate(args.recipes):
            recipe = json.loads(spec)
            view = PROMPT_VIEWS[recipe.pop("prompt", "dialogue")]
            rows = data[recipe.pop("data", "proxy")]
            train_rows = _viewed(rows, view)
            backbone = recipe.pop("backbone", DEFAULT_ENCODER)
            seed = recipe.pop("seed", 0)
            cfg = RewardModelConfig(**{"checkpoint_every": 0, **recipe})
            start = time.perf_counter()
            out = f"{models}/{index}"
            with tempfile.TemporaryDirectory() as work:
                rm = train_reward_model(cfg, train_rows, backbone=backbone, out_dir=out, work_dir=work, seed=seed)
            dev = evaluate_pairs(rm, _viewed(splits["dev"], view))
            results.append({"spec": spec, "rm": rm, "view": view, "dev": dev.metrics})
            print(
                f"RESULT {spec} train_pairs={len(rows)} dev_acc={_accuracy(dev.metrics)} ({len(splits['dev'])} "
                f"pairs) seconds={time.perf_counter() - start:.0f}",
                flush=True,
            )
        chosen = choose(results)
        for label, result in (("CHOSEN", chosen), ("BASELINE", results[0])):
            test = evaluate_pairs(result["rm"], _viewed(splits["test"], result["view"]))
            print(
                f"{label} {result['spec']} dev_acc={_accuracy(result['dev'])} test_acc={_accuracy(test.metrics)} "
                f"({len(splits['test'])} pairs)",
                flush=True,
            )


if __name__ == "__main__":
    main()
