"""Orchestration overhead: the pipeline through the Prefect flow with MLflow tracking, against the same stage
bodies called directly, on the same configuration.

    .venv/bin/python -m bench.orchestration            # the offline default, params.yaml as it is (~40 min on 2 cores)
    .venv/bin/python -m bench.orchestration --short    # the default shortened (see SHORTENED; ~15 min)
    .venv/bin/python -m bench.orchestration --tiny     # tiny models (a minute; the smoke test)

How it measures: docs/benchmark-methods.md#orchestration.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlhflow.config.output_paths import ALLOW_PATHS
from rlhflow.config.params import add_overrides_argument, set_args

# A light door: Prefect, MLflow and the stages (flows.pipeline, rlhfops.tracking) are imported where they are used.

REPO = Path(__file__).resolve().parents[1]
# the default params.yaml, shortened so that one path takes a few minutes on 2 CPU cores
SHORTENED = [
    "ppo.steps=4",
    "reward_model.epochs=0.5",
    "evaluate.n_prompts=16",
    "evaluate.perplexity_rows=16",
    "sft.perplexity_rows=16",
    "sft.n_samples=2",
    "judge.epochs=0.5",
]
TINY = [
    "data.demo.n_prompts=60",
    "sft.n_samples=2",
    "sft.max_new_tokens=8",
    "sft.perplexity_rows=8",
    "reward_model.backbone=sft",
    "reward_model.epochs=1",
    "reward_model.batch_size=8",
    "judge.backbone=sft",
    "judge.epochs=1",
    "judge.batch_size=8",
    "ppo.steps=2",
    "ppo.batch_size=4",
    "ppo.mini_batch_size=2",
    "ppo.max_new_tokens=8",
    "evaluate.n_prompts=4",
    "evaluate.max_new_tokens=8",
    "evaluate.perplexity_rows=4",
]


def root_overrides(root: Path, demo_data: bool = False) -> list[str]:
    """Every output (and the MLflow store) under `root`; the demo data as input with `demo_data` (tiny models)."""
    return [
        *([f"data.preferences={root}/data/raw/demo/preferences.jsonl"] if demo_data else []),
        f"data.demo.out_dir={root}/data/raw/demo",
        f"judge.out_dir={root}/models/judge",
        f"judge.checkpoint_dir={root}/checkpoints/judge",
        f"reward_model.checkpoint_dir={root}/checkpoints/reward_model",
        f"validate.out_dir={root}/data/validated",
        f"validate.report_dir={root}/reports/validation",
        f"sft.out_dir={root}/models/sft",
        f"reward_model.out_dir={root}/models/reward_model",
        f"ppo.out_dir={root}/models/policy",
        f"ppo.checkpoint_dir={root}/checkpoints/ppo",
        f"evaluate.report_dir={root}/reports/evaluate",
        f"evaluate.reference_dir={root}/data/sft_answers",
        f"metrics_dir={root}/metrics",
        f"tracking.tracking_uri=sqlite:///{root}/mlflow.db",
    ]


def allow_root(root: Path) -> None:
    """Let the runs' settings name `root`, the benchmark's own temporary directory outside the project: the path
    check reads $RLHFLOW_ALLOW_PATHS, which the benchmark's child processes inherit from this one."""
    os.environ[ALLOW_PATHS] = os.pathsep.join(filter(None, [os.environ.get(ALLOW_PATHS, ""), str(root)]))


def run_direct(overrides: list[str], out: Path) -> None:
    """The stage bodies in a plain loop (this runs in its own process: see main)."""
    import importlib

    from flows.pipeline import selected_stages
    from rlhflow.config.params import load_config
    from rlhfops import tracking
    from rlhfops.stage_runner import StageContext

    class DirectContext(StageContext):
        def log_metrics(self, metrics, step=None, *, on_parent=False):  # direct: nothing is tracked
            pass

    cfg = load_config(None, overrides + ["tracking.log_models=false", "tracking.register_models=false"])
    times: dict[str, float] = {}
    mlflow = tracking.setup(cfg)
    with mlflow.start_run(run_name="direct"):
        for name in selected_stages(cfg, None):
            start = time.perf_counter()
            importlib.import_module(f"tasks.{name}").run(cfg, DirectContext(stage=name))
            times[name] = time.perf_counter() - start
    out.write_text(json.dumps(times))


# What the flow's stage bodies do for tracking that the direct loop does not: module -> its functions.
TRACKING_IN_BODIES = {
    "rlhfops.tracking": ("log_metrics",),
    "rlhfops.registry": ("log_model_dir", "version_of_model_dir"),
    "rlhfops.promotion": ("challenge_champion", "apply_champion_decision"),
}


def run_flow(argv: list[str], out: Path) -> None:
    """`python -m flows.pipeline` (this runs in its own process: see main), with clocks on the tracking calls made
    inside stage bodies, and the temporary Prefect server's CPU seconds read before it stops."""
    import contextlib
    import importlib

    import psutil

    import rlhfops.stage_runner as common
    from flows import pipeline

    in_body, depth = [False], [0]
    spent = {name: 0.0 for names in TRACKING_IN_BODIES.values() for name in names}

    def clocked(name, fn):
        def wrapper(*args, **kwargs):
            if not in_body[0] or depth[0]:  # outside bodies it counts as outside time; nested calls once
                return fn(*args, **kwargs)
            depth[0] += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
                depth[0] -= 1

        return wrapper

    for module_name, names in TRACKING_IN_BODIES.items():  # stage bodies call them as attributes of these modules
        module = importlib.import_module(module_name)
        for name in names:
            setattr(module, name, clocked(name, getattr(module, name)))
    run_stage = common.run_stage

    def run_stage_marking_the_body(name, body, cfg, parent_run_id=None):
        def marked(cfg, ctx):
            in_body[0] = True
            try:
                return body(cfg, ctx)
            finally:
                in_body[0] = False

        return run_stage(name, marked, cfg, parent_run_id)

    common.run_stage = run_stage_marking_the_body  # what every stage task calls
    pipeline.main(argv)
    server_cpu = 0.0
    for child in psutil.Process().children(recursive=True):  # the temporary server, still up until exit
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            server_cpu += times.user + times.system
    out.write_text(json.dumps({"tracking_in_bodies_s": spent, "server_cpu_s": server_cpu}))


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: list[str], log: Path, env: dict) -> tuple[float, float]:
    """(wall s, CPU s) of one command, its waited-for children included."""
    cpu, start = children_cpu_s(), time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    wall, cpu = time.perf_counter() - start, children_cpu_s() - cpu
    if proc.returncode != 0:
        sys.stderr.write(log.read_text()[-6000:])
        raise SystemExit(f"{' '.join(cmd[2:5])} failed (exit {proc.returncode}); log: {log}")
    return wall, cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--short", action="store_true", help="the default shortened (SHORTENED) instead of params.yaml as it is"
    )
    size.add_argument("--tiny", action="store_true", help="tiny models instead of the default")
    add_overrides_argument(parser, "further params.yaml overrides for both paths")
    parser.add_argument("--direct-only", metavar="JSON", help=argparse.SUPPRESS)  # the direct path's own process
    parser.add_argument("--flow-only", metavar="JSON", help=argparse.SUPPRESS)  # the flow path's own process
    parser.add_argument("--keep", action="store_true", help="keep the two output roots (printed)")
    args = parser.parse_args(argv)
    if args.direct_only:
        run_direct(args.overrides, Path(args.direct_only))
        return
    if args.flow_only:
        run_flow(set_args(args.overrides), Path(args.flow_only))
        return

    tmp = Path(tempfile.mkdtemp(prefix="rlhflow-orch-"))
    allow_root(tmp)
    base = list(SHORTENED) if args.short else []
    if args.tiny:
        from tests.fixtures import write_tiny_model

        model = write_tiny_model(tmp / "tiny-model")
        base = TINY + [f"sft.model={model}"]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "GX_ANALYTICS_ENABLED": "false",
        # as the Makefile sets it: a loaded machine starts the temporary server slowly
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": os.environ.get(
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180"
        ),
    }
    walls, cpus, stage_times = {}, {}, {}
    # the flow first: any cold-cache cost of the first run is charged to the orchestrated path (conservative)
    for path in ("flow", "direct"):
        root = tmp / path
        overrides = root_overrides(root, demo_data=args.tiny) + base + args.overrides
        sets = set_args(overrides)
        if path == "flow":
            cmd = [sys.executable, "-m", "bench.orchestration", "--flow-only", str(tmp / "flow.json"), *sets]
        else:
            cmd = [sys.executable, "-m", "bench.orchestration", "--direct-only", str(tmp / "direct.json"), *sets]
        walls[path], cpus[path] = timed(cmd, tmp / f"{path}.log", env)
        if path == "flow":
            metrics_dir = root / "metrics"
            stage_times[path] = {
                p.stem: json.loads(p.read_text()).get(f"time/{p.stem}_s") for p in sorted(metrics_dir.glob("*.json"))
            }
        else:
            stage_times[path] = json.loads((tmp / "direct.json").read_text())
        print(f"  {path}: {walls[path]:.1f} s wall, {cpus[path]:.1f} s CPU", flush=True)

    names = list(stage_times["direct"])
    what = (
        "tiny models"
        if args.tiny
        else "default params, shortened: " + " ".join(SHORTENED)
        if args.short
        else "default params"
    )
    print(f"\n== orchestration overhead ({what}{', ' + ' '.join(args.overrides) if args.overrides else ''})")
    print(f"{'stage':14s} {'flow s':>9s} {'direct s':>9s}")
    for name in names:
        flow_s = stage_times["flow"].get(name)
        print(f"{name:14s} {flow_s if flow_s is not None else float('nan'):9.1f} {stage_times['direct'][name]:9.1f}")
    print(f"{'process wall':14s} {walls['flow']:9.1f} {walls['direct']:9.1f}")
    print(f"{'process CPU':14s} {cpus['flow']:9.1f} {cpus['direct']:9.1f}")
    # the attributed overhead (module docstring): outside-body time difference + tracking clocked inside bodies
    outside = {path: walls[path] - sum(t or 0.0 for t in stage_times[path].values()) for path in walls}
    flow_info = json.loads((tmp / "flow.json").read_text())
    in_bodies = flow_info["tracking_in_bodies_s"]
    attributed = outside["flow"] - outside["direct"] + sum(in_bodies.values())
    print(
        f"{'outside bodies':14s} {outside['flow']:9.1f} {outside['direct']:9.1f}   (process start, imports, the "
        "Prefect server and flow, stage runs' set-up, up-to-date checks)"
    )
    print(
        "tracking inside the flow's stage bodies: "
        + ", ".join(f"{name} {secs:.1f} s" for name, secs in in_bodies.items())
    )
    print(f"temporary Prefect server: {flow_info['server_cpu_s']:.1f} CPU s over the flow")
    ab = (walls["flow"] - walls["direct"]) / walls["flow"]
    print(
        f"A/B: flow/direct wall-time ratio {walls['flow'] / walls['direct']:.3f}, CPU-time ratio "
        f"{cpus['flow'] / cpus['direct']:.3f}, (flow - direct) / flow {ab:.3f}"
    )
    print(
        f"attributed: outside-bodies difference {outside['flow'] - outside['direct']:.1f} s + tracking in bodies "
        f"{sum(in_bodies.values()):.1f} s = {attributed:.1f} s of the flow's {walls['flow']:.1f} s"
    )
    if args.keep:
        print(f"outputs kept under {tmp}")
    else:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    print(f"orchestration_overhead={attributed / walls['flow']:.3f}")


if __name__ == "__main__":
    main()
