"""PPO settings side by side on the default pipeline: memory modes (shared value head, separate critic, LoRA), KL
settings (fixed k1, k3, adaptive) and implementation details (PPO epochs, learning-rate decay, reward normalisation
by SFT samples), each as the real `ppo` stage on the outputs of a default run.

    make run                                  # once: data/validated, models/sft, models/reward_model
    .venv/bin/python -m bench.ppo_settings    # every setting in SETTINGS
    .venv/bin/python -m bench.ppo_settings --settings shared,lora --set ppo.steps=8
    .venv/bin/python -m bench.ppo_settings --settings shared,shared_detached,separate --seeds 3   # the critics

How it measures: docs/benchmark-methods.md#ppo_settings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rlhflow.config.params import add_overrides_argument, set_args

# A light door: pandas and scipy are imported inside the functions that use them, so --help answers at once.

REPO = Path(__file__).resolve().parents[1]

# name -> (what it is, its params overrides). LoRA trains adapters with a 5x learning rate, as LoRA usually needs.
SETTINGS: dict[str, tuple[str, list[str]]] = {
    "shared": ("value head on the policy backbone (default), k1, fixed beta", []),
    "separate": (
        "separate critic (from the reward model where it reads the policy's tokens, else SFT)",
        ["ppo.value_model=separate"],
    ),
    "lora": (
        "LoRA r=16 + shared value head, reference = base with adapter off, lr 1e-4",
        ["ppo.lora.enabled=true", "ppo.learning_rate=1e-4"],
    ),
    "shared_detached": (
        "value head on the policy backbone, input detached, its own learning rate 1e-3",
        ["ppo.value_head_detach=true", "ppo.value_learning_rate=1e-3"],
    ),
    "bf16": ("shared, bf16 autocast (fp32 master weights, reference and reward model in bf16)", ["ppo.precision=bf16"]),
    "checkpointing": ("shared, gradient checkpointing", ["ppo.gradient_checkpointing=true"]),
    "micro1": (
        "shared, micro-batches of 1 response (gradient accumulation over the minibatch)",
        ["ppo.micro_batch_size=1"],
    ),
    "k3": ("shared, k3 KL estimator", ["ppo.kl_estimator=k3"]),
    "epochs4": ("shared, 4 PPO epochs per rollout batch (TRL's default)", ["ppo.ppo_epochs=4"]),
    "linear_lr": ("shared, learning rate decayed linearly to 0 over the run", ["ppo.lr_schedule=linear"]),
    "sft_norm": (
        "shared, rewards normalised by the SFT policy's scores on 64 training prompts",
        ["ppo.reward_normalization=sft"],
    ),
    "adaptive": (
        "shared, adaptive KL (target 3 nats, horizon 100)",
        ["ppo.adaptive_kl.enabled=true", "ppo.adaptive_kl.target=3", "ppo.adaptive_kl.horizon=100"],
    ),
}
TIMERS = ["time/generation_s", "time/forward_s", "time/scoring_s", "time/training_s"]


def run_setting(name: str, overrides: list[str], work: Path, threads: int) -> dict:
    import pandas as pd

    out = work / name
    paths = [
        f"ppo.out_dir={out}/policy",
        f"ppo.checkpoint_dir={out}/checkpoints",
        f"metrics_dir={out}/metrics",
        "tracking.log_models=false",
        "tracking.experiment=ppo-settings",
    ]
    cmd = [sys.executable, "-m", "tasks.ppo"] + set_args(paths + overrides)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(out / "stage.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS, not the maximum over all children
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{name} failed; log: {out / 'stage.log'}\n{(out / 'stage.log').read_text()[-3000:]}")
    metrics = json.loads((out / "metrics" / "ppo.json").read_text())
    history = pd.read_csv(out / "metrics" / "ppo_history.csv")
    update_s = history[TIMERS].sum(axis=1)
    quarter = max(1, len(history) // 4)  # the final quarter of updates, as the stage's *_final metrics
    return {
        "setting": name,
        "peak_rss_mib": usage.ru_maxrss / 1024,
        "stage_wall_s": wall,
        "update_s": float(update_s.median()),
        **{t.split("/")[1]: float(history[t].median()) for t in TIMERS},
        "score_first": metrics["ppo/score_mean_first"],
        "score_final": metrics["ppo/score_mean_final"],
        "kl_final": metrics["ppo/kl_final"],
        "kl_coef_last": float(history["ppo/kl_coef"].iloc[-1]),
        "explained_variance_final": float(history["ppo/explained_variance"].tail(quarter).mean()),
        "value_loss_final": float(history["ppo/value_loss"].tail(quarter).mean()),
        "updates": int(metrics["ppo/updates"]),
    }


SEED_FIGURES = ["score_final", "kl_final", "explained_variance_final", "value_loss_final", "update_s", "peak_rss_mib"]


def seed_table(rows: list[dict], names: list[str]) -> str:
    """Markdown: per setting, each figure's mean over the seeds with its 95% Student-t interval."""
    from rlhflow.evaluation.stats import across_seeds

    lines = ["| setting | seeds | " + " | ".join(SEED_FIGURES) + " |", "|---|---|" + "---|" * len(SEED_FIGURES)]
    for name in names:
        mine = [r for r in rows if r["setting"] == name]
        cells = []
        for figure in SEED_FIGURES:
            mean, low, high = across_seeds([r[figure] for r in mine])
            cells.append(f"{mean:.3f} ({low:.3f} to {high:.3f})" if len(mine) > 1 else f"{mean:.3f}")
        lines.append(f"| `{name}` | {len(mine)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, from {', '.join(SETTINGS)}")
    add_overrides_argument(parser, "params override for every setting", dest="extra")
    parser.add_argument("--seeds", type=int, default=1, help="training seeds 0..N-1 per setting (`seed`)")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--work-dir", default=str(REPO / "bench" / ".work" / "ppo_settings"))
    args = parser.parse_args(argv)
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown setting(s) {unknown}; choose from {list(SETTINGS)}")
    for needed in ("data/validated/train.jsonl", "models/sft", "models/reward_model"):
        if not (REPO / needed).exists():
            parser.error(f"{needed} is missing: run `make run` (or the stages up to reward_model) first")

    work = Path(args.work_dir)
    rows = []
    for name in names:
        description, overrides = SETTINGS[name]
        for seed in range(args.seeds):
            label = name if args.seeds == 1 else f"{name}/seed{seed}"
            seeded = [f"seed={seed}"] if args.seeds > 1 else []
            row = run_setting(label, overrides + args.extra + seeded, work, args.threads)
            row.update(setting=name, seed=seed)
            rows.append(row)
            print(
                f"  {label}: {row['update_s']:.1f} s/update, peak RSS {row['peak_rss_mib']:.0f} MiB, "
                f"score {row['score_first']:+.3f} -> {row['score_final']:+.3f}, KL {row['kl_final']:.2f}, "
                f"explained variance {row['explained_variance_final']:.3f}",
                flush=True,
            )
            (work / "results.json").write_text(json.dumps(rows, indent=1))

    if args.seeds > 1:
        print(f"\nPPO settings on the default pipeline, {args.seeds} training seeds each (mean, 95% interval):\n")
        print(seed_table(rows, names))
        for name in names:
            print(f"  {name}: {SETTINGS[name][0]}")
        return
    print_ratios(rows, names)


def print_ratios(rows: list[dict], names: list[str]) -> None:
    """One seed per setting: a table of each setting's figures, its time and memory as ratios against the first."""
    import pandas as pd

    base = rows[0]
    print(f"\nPPO settings on the default pipeline ({base['updates']} updates each; ratios against {base['setting']})")
    table = pd.DataFrame(rows).set_index("setting")
    table["time_ratio"] = table["update_s"] / base["update_s"]
    table["memory_ratio"] = table["peak_rss_mib"] / base["peak_rss_mib"]
    columns = [
        "peak_rss_mib",
        "memory_ratio",
        "update_s",
        "time_ratio",
        "generation_s",
        "forward_s",
        "scoring_s",
        "training_s",
        "score_first",
        "score_final",
        "kl_final",
        "kl_coef_last",
        "explained_variance_final",
    ]
    print(table[columns].to_string(float_format=lambda v: f"{v:.3f}"))
    for name in names:
        print(f"  {name}: {SETTINGS[name][0]}")
    print(f"\nmedian update time over settings: {statistics.median(r['update_s'] for r in rows):.1f} s")


if __name__ == "__main__":
    main()
