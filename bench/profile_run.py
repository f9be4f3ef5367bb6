"""Stage profile of a pipeline run: per stage, the wall seconds spent loading models, tokenizing, generating,
training, scoring, hashing and recording, logging to MLflow, and everything else.

    .venv/bin/python -m bench.profile_run          # the offline default, params.yaml as it is (~15 min on 2 cores)
    .venv/bin/python -m bench.profile_run --tiny   # tiny models (about a minute; the smoke test)
    .venv/bin/python -m bench.profile_run --set ppo.steps=4 --out profile.json

How it measures: docs/benchmark-methods.md#profile_run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import inspect
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.orchestration import TINY, allow_root, root_overrides
from rlhflow.config.params import add_overrides_argument, load_config, set_args

# A light door: Prefect and the stages (flows.pipeline) are imported inside the function that runs them.

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "bench" / ".work" / "profile_run.json"
# what the Makefile exports for `make run`; set before Prefect is imported, which reads some of them then
ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "GX_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
}

# category -> the functions it times: `module.function`, `module.Class.method`, or `module.*` (every public
# function defined in that module or package) and `module.Class.*` (every public method of the class).
TIMED: dict[str, list[str]] = {
    "loading": [
        "rlhflow.models.loading.load_causal_lm",  # from_pretrained: safetensors, or GGUF dequantisation
        "rlhflow.models.loading.load_tokenizer",
        "rlhflow.training.reward_model.load_backbone",
        "rlhflow.training.reward_model.RewardModel.load",
    ],
    "tokenization": [
        "rlhflow.models.policy.encode_prompts",
        "rlhflow.training.reward_model.encode_pair",
        "rlhflow.training.reward_model.pair_dataset",  # the reward models' tokenized training pairs
        "rlhflow.data.validation._token_counts",
        # the tokenizer's own calls, wherever they are made: decoding in generate, padding in scoring, inside trl
        "transformers.PreTrainedTokenizerBase.__call__",
        "transformers.PreTrainedTokenizerBase.encode",
        "transformers.PreTrainedTokenizerBase.pad",
        "transformers.PreTrainedTokenizerBase.decode",
        "transformers.PreTrainedTokenizerBase.batch_decode",
        "transformers.PreTrainedTokenizerBase.apply_chat_template",
    ],
    "generation": ["rlhflow.models.generation.generate"],
    "training": [
        "rlhflow.training.hf_trainer.train_resuming",  # Trainer.train: the reward model, the judge, SFT
        "rlhflow.ppo.trainer.PPOTrainer._optimize",  # the PPO epochs: forward, backward, AdamW
    ],
    "scoring": [
        "rlhflow.training.reward_model.RewardModel.raw_scores",  # every reward-model forward pass outside training
        "rlhflow.models.policy.sequence_logprobs",  # reference log-probs, KL, perplexity
        "rlhflow.evaluation.metrics.response_nll",
        "rlhflow.evaluation.metrics.response_kl",
        "rlhflow.ppo.trainer.PPOTrainer._in_chunks",  # the rollout's log-prob and value passes
        "rlhflow.models.policy.PolicyAndValue.from_generation",
    ],
    # hashes, DVC checks, records and cache
    "recording": ["rlhflow.fsutil.file_md5", "rlhfops.hashing.*", "rlhfops.stage_lock.*", "rlhfops.run_record.*"],
    "mlflow": [
        "rlhfops.tracking.*",
        "mlflow.*",  # the fluent API: runs, params, metrics, artifacts, tags
        "mlflow.MlflowClient.*",  # the registry, batches of metrics, searches
        "mlflow.MlflowClient.__init__",
        "mlflow.pyfunc.log_model",
        "mlflow.artifacts.download_artifacts",
        "mlflow.data.from_pandas",
    ],
}
CATEGORIES = [*TIMED, "other"]
OUTSIDE = "outside stages"
# the packages whose modules may hold a timed function under their own name (`from rlhflow.models.policy import
# generate`)
PROJECT_PACKAGES = ("rlhflow", "rlhfops", "tasks", "flows", "bench")


def empty_row() -> dict:
    return {
        "wall_s": 0.0,
        "covered_s": 0.0,  # time inside outermost timed calls: the categories' sum
        "seconds": dict.fromkeys(TIMED, 0.0),
        "calls": dict.fromkeys(TIMED, 0),  # entries into the category (a call not inside one of the same category)
        "functions": {},  # "module.qualname" -> {"calls", "seconds" (exclusive)}
    }


class Clock:
    """Exclusive seconds per stage and category: each timed call's time minus that of the timed calls inside it."""

    def __init__(self) -> None:
        self.current = OUTSIDE  # the stage running now
        self.rows: dict[str, dict] = {}
        self._local = threading.local()  # each thread's stack of open timed calls: [category, seconds of children]

    def row(self, stage: str) -> dict:
        return self.rows.setdefault(stage, empty_row())

    @contextlib.contextmanager
    def stage(self, name: str):
        self.current, start = name, time.perf_counter()
        try:
            yield
        finally:
            self.row(name)["wall_s"] += time.perf_counter() - start
            self.current = OUTSIDE

    def timed(self, name: str, category: str, fn):
        @functools.wraps(fn)
        def timer(*args, **kwargs):
            stack = self._local.__dict__.setdefault("stack", [])
            outer = stack[-1] if stack else None
            frame = [category, 0.0]
            stack.append(frame)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                stack.pop()
                row = self.row(self.current)
                row["seconds"][category] += elapsed - frame[1]
                row["calls"][category] += outer is None or outer[0] != category
                stats = row["functions"].setdefault(name, {"calls": 0, "seconds": 0.0})
                stats["calls"] += 1
                stats["seconds"] += elapsed - frame[1]
                if outer is None:
                    row["covered_s"] += elapsed
                else:
                    outer[1] += elapsed

        return timer


def resolve(entry: str) -> list[tuple[object, str]]:
    """The (owner, attribute name) pairs a TIMED entry names."""
    path, _, last = entry.rpartition(".")
    parts = path.split(".")
    for i in range(len(parts), 0, -1):  # the longest importable prefix is the module, the rest attributes
        try:
            owner = importlib.import_module(".".join(parts[:i]))
            break
        except ModuleNotFoundError:
            continue
    for attr in parts[i:]:
        owner = getattr(owner, attr)
    if last != "*":
        return [(owner, last)]
    home = owner.__module__ if isinstance(owner, type) else owner.__name__

    def defined_here(value) -> bool:  # not a function the module imported from elsewhere
        fn = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
        return inspect.isfunction(fn) and (fn.__module__ == home or fn.__module__.startswith(home + "."))

    return [(owner, name) for name, value in vars(owner).items() if name[0] != "_" and defined_here(value)]


@contextlib.contextmanager
def timers(clock: Clock, table: dict[str, list[str]] = TIMED):
    """Every function of `table` replaced by `clock`'s timer while the block runs; the originals put back after."""
    undo: list[tuple[object, str, object]] = []
    done: set[int] = set()  # a function two entries name is timed once, for the first

    def patch(owner, attr: str, value) -> None:
        undo.append((owner, attr, vars(owner)[attr]))
        setattr(owner, attr, value)

    try:
        for category, entries in table.items():
            for entry in entries:
                for owner, attr in resolve(entry):
                    raw = vars(owner)[attr]
                    fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
                    if id(fn) in done:
                        continue
                    done.add(id(fn))
                    timer = clock.timed(f"{fn.__module__}.{fn.__qualname__}", category, fn)
                    patch(owner, attr, timer if raw is fn else type(raw)(timer))
                    if isinstance(owner, type):
                        continue
                    # modules that imported the function by name before now hold the original
                    for name, module in list(sys.modules.items()):
                        if module is not None and name.split(".")[0] in PROJECT_PACKAGES:
                            for key, value in list(vars(module).items()):
                                if value is fn:
                                    patch(module, key, timer)
        yield
    finally:
        for owner, attr, raw in reversed(undo):
            setattr(owner, attr, raw)


@contextlib.contextmanager
def dvc_cache_in(root: Path):
    """DVC's cache under `root` while the block runs: after each stage the flow copies its outputs into the cache
    (rlhfops.stage_lock.record_run), which would otherwise be the workspace's .dvc/cache. A global DVC config of its
    own says where (the project's .dvc/config sets no cache dir, so the global one's applies)."""
    config_dir = root / "dvc-config"
    config_dir.mkdir(parents=True)
    (config_dir / "config").write_text(f"[cache]\n    dir = {root / 'dvc-cache'}\n")
    before = os.environ.get("DVC_GLOBAL_CONFIG_DIR")
    os.environ["DVC_GLOBAL_CONFIG_DIR"] = str(config_dir)
    try:
        yield
    finally:
        if before is None:
            del os.environ["DVC_GLOBAL_CONFIG_DIR"]
        else:
            os.environ["DVC_GLOBAL_CONFIG_DIR"] = before


def profile_flow(argv: list[str]) -> dict:
    """`flows.pipeline.main(argv)` with every TIMED function clocked, each stage's rows apart."""
    from flows import pipeline, pipeline_flow

    clock = Clock()
    run_or_skip = pipeline_flow.run_or_skip
    ran: dict[str, bool] = {}

    def run_or_skip_clocked(name, cfg, parent_id, force):
        with clock.stage(name):
            outcome, metrics = run_or_skip(name, cfg, parent_id, force)
        ran[name] = outcome.ran
        return outcome, metrics

    pipeline_flow.run_or_skip = run_or_skip_clocked  # what run_pipeline calls for each stage
    try:
        with timers(clock):
            start = time.perf_counter()
            pipeline.main(argv)
            total = time.perf_counter() - start
    finally:
        pipeline_flow.run_or_skip = run_or_skip
    clock.row(OUTSIDE)["wall_s"] = total - sum(row["wall_s"] for name, row in clock.rows.items() if name != OUTSIDE)
    outside = finished(clock.rows.pop(OUTSIDE))
    stages = {name: {**finished(row), "ran": ran[name]} for name, row in clock.rows.items()}
    rows = [*stages.values(), outside]
    return {
        "categories": CATEGORIES,
        "stages": stages,
        "outside_stages": outside,
        "total": {
            "wall_s": total,
            "seconds": {c: sum(r["seconds"][c] for r in rows) for c in CATEGORIES},
            "calls": {c: sum(r["calls"][c] for r in rows) for c in TIMED},
        },
    }


def finished(row: dict) -> dict:
    """A row with `other`: the wall time that no timed call covers."""
    out = {k: v for k, v in row.items() if k != "covered_s"}
    out["seconds"] = {**row["seconds"], "other": row["wall_s"] - row["covered_s"]}
    return out


def markdown_table(profile: dict) -> str:
    rows = {**profile["stages"], OUTSIDE: profile["outside_stages"], "total": profile["total"]}
    lines = [
        "| stage | " + " | ".join(CATEGORIES) + " | wall |",
        "|---" + "|---:" * (len(CATEGORIES) + 1) + "|",
    ]
    for name, row in rows.items():
        name += "" if row.get("ran", True) else " (skipped: up to date)"
        cells = [f"{row['seconds'][c]:.2f}" for c in CATEGORIES] + [f"{row['wall_s']:.2f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny models instead of the default")
    add_overrides_argument(parser, "further params.yaml overrides (repeatable)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the JSON profile (default: {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)

    root = Path(tempfile.mkdtemp(prefix="rlhflow-profile-"))
    allow_root(root)
    try:
        base: list[str] = []
        if args.tiny:
            from tests.fixtures import write_tiny_model

            base = [*TINY, f"sft.model={write_tiny_model(root / 'tiny-model')}"]
        overrides = root_overrides(root / "run", demo_data=args.tiny) + base + args.overrides
        with dvc_cache_in(root):
            profile = profile_flow(set_args(overrides))
        # the run's figures, to check that a faster run measures the same
        run_cfg = load_config(overrides=overrides)
        metrics_dir = run_cfg.path(run_cfg.metrics_dir)
        profile["metrics"] = {p.stem: json.loads(p.read_text()) for p in sorted(metrics_dir.glob("*.json"))}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    profile = {"run": "tiny models" if args.tiny else "default params", "overrides": args.overrides, **profile}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(profile, indent=2))
    what = profile["run"] + (", " + " ".join(args.overrides) if args.overrides else "")
    print(f"\n== stage profile, seconds ({what})\n")
    print(markdown_table(profile))
    print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    main()
