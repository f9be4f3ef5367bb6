"""What the stages that train with a Hugging Face Trainer (the reward models, supervised fine-tuning) share: the
training precision, Trainer checkpoints and resuming from them, and forwarding the Trainer's logs to MLflow."""

from __future__ import annotations

# transformers' Trainer pieces are imported by the functions that build them (heavy: they load peft): precision
# and checkpoint lookups need only torch, and stages that only score never pay for them.
import contextlib
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlhflow.progress import ProgressLines

LogFn = Callable[[dict, int], None]  # (metrics, step)


def use_bf16(precision: str) -> bool:
    """bf16 mixed precision for `precision` ("auto": only on a CUDA GPU with bf16 support). trl's configs default
    to bf16, which on a CPU without native bf16 (no AVX512-BF16/AMX) makes every matmul a slow fallback kernel:
    MiniLM reward-model steps took 50 s instead of 1.2 s on such a machine."""
    if precision == "auto":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return precision == "bf16"


def checkpoint_args(checkpoint_every: int) -> dict[str, Any]:
    """Trainer arguments: a checkpoint every `checkpoint_every` steps, only the last one kept (0: none)."""
    if not checkpoint_every:
        return {"save_strategy": "no"}
    return {"save_strategy": "steps", "save_steps": checkpoint_every, "save_total_limit": 1}


def last_complete_checkpoint(work_dir: str | os.PathLike) -> Path | None:
    """The newest `checkpoint-<step>` dir the Trainer finished writing: trainer_state.json is written last, so a
    checkpoint cut short by a kill has none, or one that is empty or cut mid-write, and is skipped."""
    done = [p for p in Path(work_dir).glob("checkpoint-*") if p.name.split("-")[-1].isdigit() and _state_written(p)]
    return max(done, key=lambda p: int(p.name.split("-")[-1]), default=None)


def _state_written(checkpoint: Path) -> bool:
    try:
        return isinstance(json.loads((checkpoint / "trainer_state.json").read_text()), dict)
    except (OSError, ValueError):
        return False


def log_callback(log_fn: LogFn | None):
    """A TrainerCallback passing each of the Trainer's numeric logs to `log_fn` as `train_<name>` at its step."""
    from transformers.trainer_callback import TrainerCallback

    class _LogCallback(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if log_fn and logs:
                log_fn({f"train_{k}": v for k, v in logs.items() if isinstance(v, (int, float))}, state.global_step)

    return _LogCallback()


def progress_bar_without_log_dicts(trainer) -> None:
    """The Trainer's progress bar keeps its place; the dict of figures it writes under itself at every log (and the
    run's summary at the end) is left out: the figures go to MLflow (log_callback), the bar shows the last loss."""
    from transformers.trainer_callback import ProgressCallback

    class _Bar(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and self.training_bar is not None and "loss" in (logs or {}):
                self.training_bar.set_postfix(loss=f"{logs['loss']:.4g}", refresh=False)

    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(_Bar())


def progress_lines(what: str):
    """A TrainerCallback that writes "<what>: step i of n (epoch e), loss l" at most every PROGRESS_SECONDS
    (rlhflow.progress): the run log's view of the bar."""
    from transformers.trainer_callback import TrainerCallback

    class _Lines(TrainerCallback):
        def __init__(self):
            self.lines, self.loss = ProgressLines(what), None

        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in (logs or {}):
                self.loss = logs["loss"]

        def on_step_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                loss = "" if self.loss is None else f", loss {self.loss:.4g}"
                self.lines(lambda: f"step {state.global_step} of {state.max_steps} (epoch {state.epoch:.2f}){loss}")

    return _Lines()


def train_resuming(trainer, work_dir: str | os.PathLike, *, what: str, log_fn: LogFn | None) -> None:
    """`trainer.train()`, from the last complete checkpoint in `work_dir` when there is one (the caller keeps
    `work_dir` only for the same inputs: `rlhflow.fsutil.prepare_checkpoint_dir`); says so and logs
    `resumed_from_step`. Prints one line when done: steps, seconds, mean training loss."""
    resume = last_complete_checkpoint(work_dir) if trainer.args.save_strategy != "no" else None
    if resume is not None:
        step = int(resume.name.split("-")[-1])
        print(f"{what}: resuming training from {resume.name} (step {step})", flush=True)
        if log_fn:
            log_fn({"resumed_from_step": float(step)}, step)
    progress_bar_without_log_dicts(trainer)
    trainer.add_callback(progress_lines(what))
    with trl_alias_warning_off():
        done = trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    if trainer.is_world_process_zero():
        seconds = done.metrics.get("train_runtime", float("nan"))
        print(f"{what}: trained {done.global_step} steps in {seconds:.1f} s, mean loss {done.training_loss:.4f}")


@contextlib.contextmanager
def trl_alias_warning_off():
    """While inside: no FutureWarning for trl's reads of transformers' deprecated `is_gradient_checkpointing`
    (trl.models.utils, when it builds a LoRA model and around sampling): not ours to fix; that message alone."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        yield
