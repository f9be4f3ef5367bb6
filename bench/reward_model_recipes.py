"""Reward-model recipes on the shipped human preference data: held-out pairwise accuracy with its standard error.

    .venv/bin/python -m bench.reward_model_recipes '{"learning_rate": 1e-4, "epochs": 1}' \
        '{"learning_rate": 5e-5, "epochs": 2, "pooling": "mean"}' '{"learning_rate": 1e-4, "epochs": 1, "data": "all"}'

Each argument is one recipe: `reward_model` params (see rlhflow/config.py) plus `data` ("proxy": the pairs left
after the test and judge shares, as the pipeline's proxy reward model gets them; "all": every non-test pair) and
`backbone`. The data: the shipped hh-rlhf harmless-base pairs without blank responses, 20% of the prompts held out
for testing (seed 0), a third of the rest for the judge (seed 1). One line per recipe: `RESULT ... acc=... +- s.e.`.
About 5 minutes per epoch of MiniLM on 2 CPU cores."""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from rlhflow.config import DEFAULT_ENCODER, DEFAULT_PREFERENCES, REPO_ROOT, RewardModelConfig
from rlhflow.data.formats import load_preferences
from rlhflow.reward_model import evaluate_pairs, train_reward_model
from rlhflow.validation import split_by_prompt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="+", help="JSON objects: reward_model params plus data and backbone")
    args = parser.parse_args(argv)

    df = load_preferences(str(REPO_ROOT / DEFAULT_PREFERENCES))
    df = df[(df["chosen"].str.strip() != "") & (df["rejected"].str.strip() != "")]
    non_test, test = split_by_prompt(df, 0.2, seed=0)
    proxy, judge = split_by_prompt(non_test, 0.33, seed=1)
    data = {"proxy": proxy.to_dict("records"), "all": non_test.to_dict("records")}
    test_rows = test.to_dict("records")
    print(f"pairs: proxy {len(proxy)}, judge {len(judge)}, all non-test {len(non_test)}, test {len(test)}", flush=True)
    for recipe in map(json.loads, args.recipes):
        rows = data[recipe.pop("data", "proxy")]
        backbone = recipe.pop("backbone", DEFAULT_ENCODER)
        cfg = RewardModelConfig(**{"checkpoint_every": 0, **recipe})
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as work:
            rm = train_reward_model(cfg, rows, backbone=backbone, out_dir=out, work_dir=work, seed=0)
            held_out = evaluate_pairs(rm, test_rows).metrics
        print(
            f"RESULT {backbone} train_pairs={len(rows)} {recipe} acc={held_out['accuracy']:.3f} "
            f"+- {held_out['accuracy_se']:.3f} ({len(test_rows)} pairs) seconds={time.perf_counter() - start:.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
