"""The stage profile of this tree against another commit's (`--against`, in a temporary git worktree), runs
alternating: per stage the wall seconds of both and their ratio, and which figures differ, by how much.

    .venv/bin/python -m bench.profile_compare                      # against PREVIOUS_DEFAULT (~30 min on 2 cores)
    .venv/bin/python -m bench.profile_compare --against HEAD~3 --rounds 2
    .venv/bin/python -m bench.profile_compare --tiny               # tiny models (a few minutes; the smoke test)

How it measures: docs/benchmark-methods.md#profile_compare.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rlhflow.config.params import add_overrides_argument

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "bench" / ".work" / "profile_compare.json"
# the default run before evaluate took the SFT model's perplexity and the proxy's held-out scores from their
# stages and before perplexity and KL batched rows by length (docs/benchmarks.md, "Stage profile")
PREVIOUS_DEFAULT = "3531009"


def profile(tree: Path, out: Path, args: list[str]) -> dict:
    """`bench.profile_run` with the code of `tree`, in a process of its own."""
    cmd = [sys.executable, "-m", "bench.profile_run", "--out", str(out), *args]
    subprocess.run(cmd, cwd=tree, check=True)  # `-m` puts `tree` first on sys.path: its packages are the ones run
    return json.loads(out.read_text())


def differing_metrics(before: dict, after: dict) -> dict[str, dict]:
    """The figures of two runs' `metrics/*.json` that are not equal (timings aside): both values and the
    relative difference; a figure only one run has is listed with None for the other."""
    out = {}
    for stage in sorted(set(before) | set(after)):
        old, new = before.get(stage, {}), after.get(stage, {})
        for key in sorted(set(old) | set(new)):
            if key.startswith("time/"):
                continue
            a, b = old.get(key), new.get(key)
            if a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)):
                continue
            relative = abs(b - a) / max(abs(a), 1e-12) if a is not None and b is not None else None
            out[f"{stage}:{key}"] = {"before": a, "after": b, "relative": relative}
    return out


def compared(before: list[dict], after: list[dict]) -> dict:
    """Per stage the median wall seconds of each side over the rounds, and after / before."""
    stages = list(after[0]["stages"]) + [s for s in before[0]["stages"] if s not in after[0]["stages"]]
    rows = {}

    def wall(p: dict, name: str) -> float | None:
        row = p["total"] if name == "total" else p["stages"].get(name)
        return None if row is None else row["wall_s"]

    for name in [*stages, "total"]:
        b = [w for w in (wall(p, name) for p in before) if w is not None]
        a = [w for w in (wall(p, name) for p in after) if w is not None]
        b_med, a_med = (statistics.median(b) if b else None), (statistics.median(a) if a else None)
        ratio = a_med / b_med if a_med is not None and b_med else None
        rows[name] = {"before_s": b_med, "after_s": a_med, "ratio": ratio}
    return rows


def markdown(rows: dict, against: str, this: str = "this tree") -> str:
    """One row per stage: median wall seconds of `against` and of `this`, and this / against."""

    def cell(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lines = [f"| stage | {against}, s | {this}, s | ratio |", "|---|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {cell(r['before_s'], '.1f')} | {cell(r['after_s'], '.1f')} | {cell(r['ratio'], '.2f')} |"
        )
    return "\n".join(lines)


def add_sides_arguments(parser: argparse.ArgumentParser, out: Path) -> None:
    """The options of a benchmark that profiles two sides alternating: --rounds, --tiny, --set and --out."""
    parser.add_argument("--rounds", type=int, default=1, help="runs of each side, alternating (medians reported)")
    parser.add_argument("--tiny", action="store_true", help="tiny models instead of the default")
    add_overrides_argument(parser, "params.yaml overrides for both sides (repeatable)")
    parser.add_argument("--out", type=Path, default=out, help=f"the JSON (default: {out})")


def profile_run_args(args: argparse.Namespace) -> list[str]:
    """`bench.profile_run`'s arguments for both sides, from add_sides_arguments' options."""
    return (["--tiny"] if args.tiny else []) + [a for kv in args.overrides for a in ("--set", kv)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default=PREVIOUS_DEFAULT, help=f"the commit (default {PREVIOUS_DEFAULT})")
    add_sides_arguments(parser, DEFAULT_OUT)
    args = parser.parse_args(argv)
    profile_args = profile_run_args(args)

    with tempfile.TemporaryDirectory(prefix="rlhflow-compare-") as tmp:
        work = Path(tmp)
        ref_tree = work / "against"
        git = ["git", "-C", str(REPO)]
        subprocess.run([*git, "worktree", "add", "--detach", "--quiet", str(ref_tree), args.against], check=True)
        try:
            before, after = [], []
            for i in range(args.rounds):
                before.append(profile(ref_tree, work / f"against-{i}.json", profile_args))
                after.append(profile(REPO, work / f"this-{i}.json", profile_args))
        finally:
            subprocess.run([*git, "worktree", "remove", "--force", str(ref_tree)], check=False)

    rows = compared(before, after)
    differing = differing_metrics(before[-1].get("metrics", {}), after[-1].get("metrics", {}))
    figures = sum(1 for stage in after[-1].get("metrics", {}).values() for key in stage if not key.startswith("time/"))
    result = {"against": args.against, "rounds": args.rounds, "stages": rows, "figures": figures}
    result |= {"differing_metrics": differing, "profiles": {"against": before, "this_tree": after}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\n== wall seconds, {args.against} against this tree (median of {args.rounds})\n")
    print(markdown(rows, args.against))
    print(f"\n{figures - len(differing)} of {figures} figures equal to every digit; the others:")
    for key, d in differing.items():
        rel = "-" if d["relative"] is None else f"{d['relative']:.1e}"
        print(f"  {key}: {d['before']!r} -> {d['after']!r} (relative {rel})")
    print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    main()
