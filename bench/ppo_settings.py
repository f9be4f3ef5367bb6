"""PPO settings side by side on the default pipeline: memory modes (shared value head, separate critic, LoRA), KL
settings (fixed k1, k3, adaptive) and implementation details (PPO epochs, learning-rate decay, reward normalisation
by SFT samples), each as the real `ppo` stage on the outputs of a default run.

    make run                                  # once: data/validated, models/sft, models/reward_model
    .venv/bin/python -m bench.ppo_settings    # every setting in SETTINGS
    .venv/bin/python -m bench.ppo_settings --settings shared,lora --set ppo.steps=8

Each setting runs `python -m tasks.ppo --set ...` in a fresh process, in turn, writing its policy, checkpoints and
metrics under bench/.work/ppo_settings/<setting>/ (model logging off, MLflow experiment `ppo-settings`), so the
default run's outputs are only read. Per setting it prints the process's peak RSS (`wait4`), the median update
time and its split (from the stage's own timers), the final reward-model score and KL (means over the last quarter
of updates, `ppo/score_mean_final` and `ppo/kl_final`), the first update's score, and the last KL coefficient.
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

import pandas as pd

from rlhflow.config import add_overrides_argument, set_args

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
        "updates": int(metrics["ppo/updates"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, from {', '.join(SETTINGS)}")
    add_overrides_argument(parser, "params override for every setting", dest="extra")
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
        row = run_setting(name, overrides + args.extra, work, args.threads)
        rows.append(row)
        print(
            f"  {name}: {row['update_s']:.1f} s/update, peak RSS {row['peak_rss_mib']:.0f} MiB, "
            f"score {row['score_first']:+.3f} -> {row['score_final']:+.3f}, KL {row['kl_final']:.2f}",
            flush=True,
        )
        (work / "results.json").write_text(json.dumps(rows, indent=1))

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
    ]
    print(table[columns].to_string(float_format=lambda v: f"{v:.3f}"))
    for name in names:
        print(f"  {name}: {SETTINGS[name][0]}")
    print(f"\nmedian update time over settings: {statistics.median(r['update_s'] for r in rows):.1f} s")


if __name__ == "__main__":
    main()
