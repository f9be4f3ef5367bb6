"""Every stage's wall time in fp32 against bf16, side by side: the default pipeline as `make run` runs it, once
with every stage's `precision` at fp32 and once at bf16, alternating; per stage the median seconds, and which
figures differ.

    .venv/bin/python -m bench.precision_stages                  # the default pipeline twice (~40 min on 2 cores)
    .venv/bin/python -m bench.precision_stages --tiny           # tiny models (a few minutes; the smoke test)
    .venv/bin/python -m bench.precision_stages --rounds 2 --set ppo.steps=10

How it measures: docs/benchmark-methods.md#precision_stages.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.profile_compare import (
    add_sides_arguments,
    compared,
    differing_metrics,
    markdown,
    profile,
    profile_run_args,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "bench" / ".work" / "precision_stages.json"
# every stage's precision key (the judge takes reward_model's, align's algorithms are not in the default chain)
PRECISION_KEYS = ("sft.precision", "reward_model.precision", "ppo.precision", "align.precision", "evaluate.precision")


def precision_overrides(precision: str) -> list[str]:
    """`--set` arguments putting every stage at `precision`."""
    return [a for key in PRECISION_KEYS for a in ("--set", f"{key}={precision}")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sides_arguments(parser, DEFAULT_OUT)
    args = parser.parse_args(argv)
    common = profile_run_args(args)

    runs: dict[str, list[dict]] = {"fp32": [], "bf16": []}
    with tempfile.TemporaryDirectory(prefix="rlhflow-precision-") as tmp:
        for i in range(args.rounds):
            for precision in ("fp32", "bf16") if i % 2 == 0 else ("bf16", "fp32"):
                out = Path(tmp) / f"{precision}-{i}.json"
                runs[precision].append(profile(REPO, out, common + precision_overrides(precision)))

    rows = compared(runs["fp32"], runs["bf16"])
    differing = differing_metrics(runs["fp32"][-1].get("metrics", {}), runs["bf16"][-1].get("metrics", {}))
    result = {"rounds": args.rounds, "stages": rows, "differing_metrics": differing, "profiles": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\n== wall seconds, every stage in fp32 and in bf16 (median of {args.rounds}; ratio bf16 / fp32)\n")
    print(markdown(rows, "fp32", "bf16"))
    print(f"\n{len(differing)} figures differ between the two; JSON: {args.out}")


if __name__ == "__main__":
    main()
