"""PPO throughput and memory: our engine against TRL 1.12's PPOTrainer, same workload, alternating A B A B.

    .venv/bin/python -m bench.ppo_bench                       # tiny + smollm2 on CPU (+ the GPU shapes on a GPU)
    .venv/bin/python -m bench.ppo_bench --workloads tiny --rounds 2

How it measures: docs/benchmark-methods.md#ppo_bench.
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

from bench.common import PHASES
from bench.workloads import CPU_WORKLOADS, GPU_WORKLOADS, WORKLOADS, prepare

# A light door: torch and transformers are imported inside the functions that use them, so --help answers at once.

REPO = Path(__file__).resolve().parents[1]
ENGINES = ("ours", "trl")
# Our engine's memory modes, run in each round after the A B pair (same workload; TRL has neither): the value head
# on the policy backbone (no critic copy), and LoRA adapters with that head (the reference is the adapter-free base).
VARIANTS = {"ours-shared": ["--value-model", "shared"], "ours-lora": ["--value-model", "shared", "--lora"]}
SMOKE_WORKLOADS = {"tiny"}

# Dense bf16 tensor-core FLOP/s and memory bandwidth (bytes/s) from the vendors' data sheets, by device name.
# BENCH_PEAK_TFLOPS / BENCH_PEAK_TBPS override them (and are needed for devices not listed).
GPU_PEAKS = [
    ("H200", 989.4e12, 4.8e12),
    ("H100 NVL", 835e12, 3.9e12),
    ("H100 PCIe", 756e12, 2.0e12),
    ("H100", 989.4e12, 3.35e12),  # SXM (HBM3)
    ("A100-SXM4-80GB", 312e12, 2.039e12),
    ("A100 80GB PCIe", 312e12, 1.935e12),
    ("A100", 312e12, 1.555e12),
    ("L40S", 362e12, 0.864e12),
    ("L4", 121e12, 0.3e12),
]


def gpu_peaks() -> tuple[str, float | None, float | None]:
    import torch

    name = torch.cuda.get_device_name()
    flops = bandwidth = None
    for key, f, b in GPU_PEAKS:
        if key in name:
            flops, bandwidth = f, b
            break
    if os.environ.get("BENCH_PEAK_TFLOPS"):
        flops = float(os.environ["BENCH_PEAK_TFLOPS"]) * 1e12
    if os.environ.get("BENCH_PEAK_TBPS"):
        bandwidth = float(os.environ["BENCH_PEAK_TBPS"]) * 1e12
    return name, flops, bandwidth


def run_engine(
    engine: str, workload_dir: Path, out: Path, *, threads: int, trl_python: str, profile: Path | None = None
) -> dict:
    """One fresh process of `engine` ("ours", "trl" or one of VARIANTS) on a prepared workload."""
    runner = "trl" if engine == "trl" else "ours"
    python = trl_python if runner == "trl" else sys.executable
    cmd = [
        python,
        "-m",
        f"bench.run_{runner}",
        "--workload-dir",
        str(workload_dir),
        "--out",
        str(out),
        "--threads",
        str(threads),
        *VARIANTS.get(engine, []),
    ]
    if profile is not None:
        cmd += ["--profile", str(profile)]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "PYTHONPATH": str(REPO),
    }
    log = out.with_suffix(".log")
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.stderr.write(log.read_text()[-6000:])
        raise SystemExit(f"{engine} failed on {workload_dir.name} (exit {proc.returncode}); log: {log}")
    result = json.loads(out.read_text())
    result["process_wall_s"] = time.perf_counter() - start
    return result


def median_update(results: list[dict]) -> dict[str, float]:
    """Median over every measured update of every round, per phase."""
    updates = [u for r in results for u in r["updates"]]
    keys = ("total_s", *PHASES)
    return {k: statistics.median(u[k] for u in updates) for k in keys}


def round_speedups(runs: dict[str, list[dict]]) -> list[float]:
    """Per round: TRL's median update time / ours (> 1: ours is faster)."""
    return [
        statistics.median(u["total_s"] for u in t["updates"]) / statistics.median(u["total_s"] for u in o["updates"])
        for o, t in zip(runs["ours"], runs["trl"])
    ]


def roofline(spec: dict, med: dict[str, float], flops: float | None, bandwidth: float | None) -> dict[str, float]:
    """Fractions of the hardware limit (README "Benchmarks"): decode time against the bandwidth bound (weights
    plus the KV cache read for every generated token), training against 6 x parameters FLOPs per trained token."""
    shape = spec["shape"]
    B, T, P = spec["batch_size"], spec["max_new_tokens"], spec["prompt_length"]
    out = {}
    if bandwidth:
        kv_per_token = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * shape["dtype_bytes"]
        bytes_read = T * shape["weight_bytes"] + B * kv_per_token * sum(P + s for s in range(T))
        out["decode_vs_bandwidth_bound"] = bytes_read / bandwidth / med["generation_s"]
    if flops:
        trained_tokens = spec["ppo_epochs"] * B * (P + T)
        train_flops = 6 * (shape["policy_matmul_params"] + shape["critic_matmul_params"]) * trained_tokens
        out["training_mfu"] = train_flops / flops / med["training_s"]
    return out


def fmt_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report(workload: str, spec: dict, runs: dict[str, list[dict]], peaks: tuple | None) -> tuple[str, list[float]]:
    meds = {e: median_update(runs[e]) for e in ENGINES}
    mems = {e: max(r["peak_memory_bytes"] for r in runs[e]) for e in ENGINES}
    B, T = spec["batch_size"], spec["max_new_tokens"]
    rows = [
        [
            "engine",
            "update s",
            "generation s",
            "scoring s",
            "training s",
            "samples/s",
            "gen tokens/s",
            f"peak mem MiB ({runs['ours'][0]['memory_kind']})",
        ]
    ]
    for e in ENGINES:
        m = meds[e]
        rows.append(
            [
                e,
                f"{m['total_s']:.3f}",
                f"{m['generation_s']:.3f}",
                f"{m['scoring_s']:.3f}",
                f"{m['training_s']:.3f}",
                f"{B / m['total_s']:.2f}",
                f"{B * T / m['total_s']:.1f}",
                f"{mems[e] / 2**20:.0f}",
            ]
        )
    o, t = meds["ours"], meds["trl"]
    rows.append(
        [
            "ours/TRL time",
            f"{o['total_s'] / t['total_s']:.2f}",
            *[f"{o[p] / t[p]:.2f}" if t[p] > 0 else "-" for p in PHASES],
            f"{t['total_s'] / o['total_s']:.2f}",
            f"{t['total_s'] / o['total_s']:.2f}",
            f"{mems['ours'] / mems['trl']:.2f}",
        ]
    )
    speedups = round_speedups(runs)
    head = (
        f"\n== {workload}: {spec['model']} on {spec['device']} ({spec['dtype']}), batch {B}, minibatch "
        f"{spec['mini_batch_size']}, {spec['ppo_epochs']} PPO epoch(s), {T} new tokens (EOS unreachable), "
        f"prompt length {spec['prompt_length']}, {runs['ours'][0]['threads']} thread(s); "
        f"{len(speedups)} rounds x {spec['updates']} measured updates (+{spec['warmup']} warm-up)"
    )
    lines = [
        head,
        fmt_table(rows),
        f"speedup (TRL update time / ours) per round: {', '.join(f'{s:.2f}' for s in speedups)}; "
        f"median {statistics.median(speedups):.2f}",
        "(ours/TRL time: below 1 is faster; samples/s and tokens/s columns of that row: ours/TRL throughput; "
        "memory: ours/TRL)",
    ]
    if peaks is not None:
        name, flops, bandwidth = peaks
        for e in ENGINES:
            fr = roofline(spec, meds[e], flops, bandwidth)
            parts = [f"{k} {v:.1%}" for k, v in fr.items()] or ["peak figures unknown: set BENCH_PEAK_TFLOPS/TBPS"]
            lines.append(f"{e} on {name}: " + ", ".join(parts))
    variants = [v for v in VARIANTS if runs.get(v)]
    if variants:
        rows = [
            [
                "ours, memory mode",
                "trained params",
                "update s",
                "training s",
                "peak mem MiB",
                "time vs TRL",
                "memory vs TRL",
            ]
        ]
        for name in ("ours", *variants):
            m, mem = median_update(runs[name]), max(r["peak_memory_bytes"] for r in runs[name])
            rows.append(
                [
                    f"{name} ({MODE_LABELS[name]})",
                    f"{runs[name][0]['trained_params'] / 1e6:.2f}M",
                    f"{m['total_s']:.3f}",
                    f"{m['training_s']:.3f}",
                    f"{mem / 2**20:.0f}",
                    f"{m['total_s'] / t['total_s']:.2f}",
                    f"{mem / mems['trl']:.2f}",
                ]
            )
        lines += ["", fmt_table(rows)]
    return "\n".join(lines), speedups


MODE_LABELS = {"ours": "separate critic", "ours-shared": "shared value head", "ours-lora": "LoRA + shared head"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workloads",
        default=None,
        help=f"comma-separated, from {', '.join(WORKLOADS)} (default: {', '.join(CPU_WORKLOADS)}, "
        "plus the GPU ones when CUDA is available)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="A B rounds per workload (default 2)")
    parser.add_argument(
        "--threads",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="torch threads for both engines (default: min(2, cores))",
    )
    parser.add_argument("--work-dir", default=str(REPO / "bench" / ".work"), help="prepared workloads and results")
    parser.add_argument("--trl-python", default=str(REPO / "bench" / ".venv-trl" / "bin" / "python"))
    parser.add_argument("--profile", action="store_true", help="also write torch.profiler tables (last round)")
    parser.add_argument(
        "--no-variants", action="store_true", help=f"skip our memory modes ({', '.join(VARIANTS)}); only the A B pair"
    )
    args = parser.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available()
    names = args.workloads.split(",") if args.workloads else CPU_WORKLOADS + (GPU_WORKLOADS if cuda else [])
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}")
    if not Path(args.trl_python).exists():
        parser.error(f"no peer venv at {args.trl_python}: run `make bench` (it builds bench/.venv-trl once)")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)

    all_speedups: dict[str, list[float]] = {}
    for name in names:
        workload = WORKLOADS[name]
        if workload.device == "cuda" and not cuda:
            print(f"\n== {name}: skipped (needs a CUDA GPU)")
            continue
        wdir = prepare(workload, work)
        spec = json.loads((wdir / "workload.json").read_text())
        engines = ENGINES if args.no_variants else (*ENGINES, *VARIANTS)
        runs: dict[str, list[dict]] = {e: [] for e in engines}
        for r in range(args.rounds):
            for engine in engines:  # A B (C D) A B (C D) ...
                profile = wdir / f"profile-{engine}.txt" if args.profile and r == args.rounds - 1 else None
                result = run_engine(
                    engine,
                    wdir,
                    wdir / f"result-{engine}-{r}.json",
                    threads=args.threads,
                    trl_python=args.trl_python,
                    profile=profile,
                )
                runs[engine].append(result)
                print(
                    f"  {name} round {r + 1}/{args.rounds} {engine}: "
                    f"{statistics.median(u['total_s'] for u in result['updates']):.3f} s/update",
                    flush=True,
                )
        text, speedups = report(name, spec, runs, gpu_peaks() if workload.device == "cuda" else None)
        print(text, flush=True)
        all_speedups[name] = speedups
        (wdir / "summary.json").write_text(json.dumps({"runs": runs, "speedups": speedups}, indent=1))

    if not all_speedups:
        raise SystemExit("no workload ran")
    real = [s for n, ss in all_speedups.items() if n not in SMOKE_WORKLOADS for s in ss]
    headline = real or [s for ss in all_speedups.values() for s in ss]
    print(f"\nppo_speedup_vs_trl={statistics.median(headline):.2f}")


if __name__ == "__main__":
    main()
