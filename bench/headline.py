"""The default pipeline's result over training seeds: the table the README and docs/results.md show.

    .venv/bin/python -m bench.headline --seeds 3       # make run at seed 0, 1, 2 in this workspace (~35 min, 2 cores)
    .venv/bin/python -m bench.headline --table-only    # the table again from the saved figures, nothing run

Each seed is `python -m flows.pipeline --set seed=S` (make run's command, at another training seed: the SFT samples,
the proxy and PPO move; the splits, the judge and the evaluation's sampling seed stay). A seed already run in the
workspace skips every stage (up to date). The workspace ends with the last seed's outputs; `make run` brings the
default back. Each seed's figures go to bench/.work/headline/seed-S.json with the machine's CPU and torch's kernel
path, and the table to bench/.work/headline/table.md: each seed's figure with its 95% interval, their range, and a
sentence of conclusion only where every seed agrees.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / ".work" / "headline"
METRIC_FILES = ("evaluate", "judge", "reward_model")

# (metric, label, the value a conclusion is drawn against or None): the rows of the table, in order
ROWS = [
    ("eval/judge_win_rate_vs_sft", "judge win rate vs SFT", 0.5),
    ("eval/judge_win_rate_both_ended", "judge win rate, both ended", 0.5),
    ("eval/judge_win_rate_lc", "judge win rate, length-controlled", 0.5),
    ("eval/win_rate_vs_sft", "proxy win rate vs SFT", 0.5),
    ("eval/answers_ended", "policy answers ended", None),
    ("eval/answers_ended_sft", "SFT answers ended", None),
    ("eval/answer_tokens", "policy answer tokens (mean)", None),
    ("eval/kl", "KL to SFT (nats per answer)", None),
    ("rm/accuracy", "proxy accuracy, test pairs", None),
    ("rm/accuracy_lc", "proxy accuracy, length-controlled", 0.5),
    ("judge/accuracy_minus_length_baseline", "judge accuracy minus the length rule", 0.0),
]
# a win rate's interval is logged without the `_vs_sft` suffix (eval/judge_win_rate_ci_low)
INTERVAL_NAMES = {"eval/judge_win_rate_vs_sft": "eval/judge_win_rate", "eval/win_rate_vs_sft": "eval/win_rate"}


def machine() -> dict[str, str]:
    """The CPU and the kernel path torch takes on it (GUIDE: a kernel path acts as a seed)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    capability = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip()
    return {
        "cpu": names[0] if names else platform.processor() or "unknown",
        "cores": str(os.cpu_count()),
        "torch_cpu_capability": capability or "unknown",
    }


def run_seed(seed: int, overrides: list[str]) -> dict[str, float]:
    """make run's flow at `seed`; its figures from the stages' metrics files. A failed run stops everything."""
    sets = [arg for o in [f"seed={seed}", *overrides] for arg in ("--set", o)]
    print(f"headline: seed {seed}: python -m flows.pipeline {' '.join(sets)}", flush=True)
    subprocess.run([sys.executable, "-m", "flows.pipeline", *sets], cwd=REPO, check=True)
    figures: dict[str, float] = {}
    for name in METRIC_FILES:
        path = REPO / "metrics" / f"{name}.json"
        figures.update(json.loads(path.read_text()) if path.exists() else {})
    return figures


def interval(figures: dict[str, float], key: str) -> tuple[float, float, float]:
    base = INTERVAL_NAMES.get(key, key)
    nan = math.nan
    return figures.get(key, nan), figures.get(f"{base}_ci_low", nan), figures.get(f"{base}_ci_high", nan)


def conclusion(label: str, seeds: list[int], values: list[tuple[float, float, float]], null: float) -> str:
    """A sentence on which side of `null` the figure lies, said only as far as every seed agrees."""
    for side, beyond, clear in (("above", lambda v: v > null, 1), ("below", lambda v: v < null, 2)):
        if all(beyond(v[0]) for v in values):
            unclear = [s for s, v in zip(seeds, values) if not beyond(v[clear])]
            if not unclear:
                return f"{label}: {side} {null:g} at every seed, each interval {side} it."
            return f"{label}: {side} {null:g} at every seed; the interval reaches {null:g} at seed(s) {unclear}."
    above = [s for s, v in zip(seeds, values) if v[0] > null]
    return f"{label}: the seeds disagree (above {null:g} at seed(s) {above} alone): no conclusion."


def cell(value: tuple[float, float, float], digits: int = 3) -> str:
    v, lo, hi = value
    if math.isnan(v):
        return "-"
    return f"{v:.{digits}f}" + ("" if math.isnan(lo) else f" ({lo:.{digits}f} to {hi:.{digits}f})")


def table(results: dict[int, dict]) -> str:
    seeds = sorted(results)
    figures = {s: results[s]["figures"] for s in seeds}
    where = results[seeds[0]]["machine"]
    lines = [
        f"Seeds {', '.join(map(str, seeds))}; {where['cpu']} ({where['cores']} cores, torch kernels "
        f"{where['torch_cpu_capability']}); 95% intervals over conversations (Wilson for accuracies).",
        "",
        "| figure | " + " | ".join(f"seed {s}" for s in seeds) + " | range over seeds |",
        "|---|" + "---:|" * (len(seeds) + 1),
    ]
    notes = []
    for key, label, null in ROWS:
        values = [interval(figures[s], key) for s in seeds]
        points = [v for v, _, _ in values if not math.isnan(v)]
        if not points:
            continue
        spread = f"{min(points):.3f} to {max(points):.3f}"
        lines.append(f"| {label} (`{key}`) | " + " | ".join(cell(v) for v in values) + f" | {spread} |")
        if null is not None and len(points) == len(seeds):
            notes.append(conclusion(label, seeds, values, null))
    return "\n".join(lines + ["", *[f"- {n}" for n in notes]]) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="training seeds 0..N-1 (default 3)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="a params override for every seed")
    parser.add_argument("--table-only", action="store_true", help="the table from the saved figures; nothing run")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    OUT.mkdir(parents=True, exist_ok=True)
    results = {}
    for seed in range(args.seeds):
        saved = OUT / f"seed-{seed}.json"
        if not args.table_only:
            record = {"seed": seed, "overrides": args.overrides, "machine": machine()}
            record["figures"] = run_seed(seed, args.overrides)
            saved.write_text(json.dumps(record, indent=1))
        if saved.exists():
            results[seed] = json.loads(saved.read_text())
    if not results:
        sys.exit(f"no saved figures in {OUT}: run without --table-only first")
    markdown = table(results)
    (OUT / "table.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main(sys.argv[1:])
