"""Reward-model recipes on the pipeline's validated splits: held-out pairwise accuracy with its standard error.

    .venv/bin/python -m bench.reward_model_recipes '{"learning_rate": 1e-4, "epochs": 1}' \
        '{"learning_rate": 5e-5, "epochs": 2, "pooling": "mean"}' '{"data": "all", "prompt": "last_turn"}'

Each argument is one recipe: `reward_model` params (see rlhflow/config.py) plus
- `data`: "proxy" (the train split, as the pipeline's proxy reward model gets it) or "all" (train and judge splits);
- `prompt`: what of the dialogue the model reads before the response: "dialogue" (all of it, as the pipeline
  does), "last_turn" (the last user message only) or "none" (the response alone);
- `backbone` (default: the pipeline's encoder; "models/sft" for the SFT model) and `seed` (default 0).
Every recipe is scored on the test split the pipeline's `rm/accuracy` uses. The splits are the `validate` stage's
outputs for params.yaml: run `dvc repro validate` (or `make run`) first. One line per recipe:
`RESULT ... acc=... +- s.e.`. About 2 minutes per epoch of MiniLM on 2 CPU cores, 16 for the SFT model."""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from rlhflow.config import DEFAULT_ENCODER, RewardModelConfig, load_config
from rlhflow.data.readers import read_jsonl
from rlhflow.reward_model import evaluate_pairs, train_reward_model

PROMPT_VIEWS = {
    "dialogue": lambda messages: messages,
    "last_turn": lambda messages: [m for m in messages if m["role"] == "user"][-1:],
    "none": lambda messages: [],
}


def validated_splits() -> dict[str, list[dict]]:
    cfg = load_config()
    validated = cfg.path(cfg.validate_.out_dir)
    splits = {}
    for split in ("train", "judge", "test"):
        path = validated / f"{split}.jsonl"
        if not path.exists():
            raise SystemExit(f"{path} is missing: run `dvc repro validate` (or `make run`) first")
        splits[split] = read_jsonl(path).to_dict("records")
    return splits


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="+", help="JSON: reward_model params, data, prompt, backbone, seed")
    args = parser.parse_args(argv)

    splits = validated_splits()
    data = {"proxy": splits["train"], "all": splits["train"] + splits["judge"]}
    print(f"pairs: proxy {len(data['proxy'])}, all {len(data['all'])}, test {len(splits['test'])}", flush=True)
    for spec in args.recipes:
        recipe = json.loads(spec)
        view = PROMPT_VIEWS[recipe.pop("prompt", "dialogue")]
        rows = data[recipe.pop("data", "proxy")]
        train_rows = [{**r, "prompt_messages": view(r["prompt_messages"])} for r in rows]
        test_rows = [{**r, "prompt_messages": view(r["prompt_messages"])} for r in splits["test"]]
        backbone = recipe.pop("backbone", DEFAULT_ENCODER)
        seed = recipe.pop("seed", 0)
        cfg = RewardModelConfig(**{"checkpoint_every": 0, **recipe})
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as work:
            rm = train_reward_model(cfg, train_rows, backbone=backbone, out_dir=out, work_dir=work, seed=seed)
            held_out = evaluate_pairs(rm, test_rows).metrics
        print(
            f"RESULT {spec} train_pairs={len(rows)} acc={held_out['accuracy']:.3f} "
            f"+- {held_out['accuracy_se']:.3f} ({len(test_rows)} pairs) seconds={time.perf_counter() - start:.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
