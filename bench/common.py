"""What both engine runners share. This module runs in the project venv and in the peer's venv (bench/.venv-trl,
which has torch and transformers but not rlhflow), so it imports neither rlhflow nor trl.

A runner measures `warmup + updates` PPO updates of one engine on one prepared workload directory and writes a
JSON result: per measured update the wall time and its split into generation, scoring (reference, reward and
value forward passes, everything between sampling and the first training step) and training (the PPO epochs),
plus the peak memory of the process (CPU: peak RSS; GPU: torch.cuda.max_memory_allocated).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

PHASES = ("generation_s", "scoring_s", "training_s")


def runner_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workload-dir", required=True, help="a directory written by bench.workloads.prepare")
    parser.add_argument("--out", required=True, help="where to write the JSON result")
    parser.add_argument("--threads", type=int, required=True, help="torch intra-op threads (same for both engines)")
    parser.add_argument(
        "--value-model",
        choices=["separate", "shared"],
        default="separate",
        help="ours only: TRL's PPO always trains a separate value model",
    )
    parser.add_argument("--lora", action="store_true", help="ours only: train a LoRA policy")
    parser.add_argument("--profile", default=None, help="write a torch.profiler table of the measured updates here")
    return parser.parse_args()


def load_spec(workload_dir: str | os.PathLike) -> dict:
    return json.loads((Path(workload_dir) / "workload.json").read_text())


def setup_torch(threads: int, seed: int):
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    return torch


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def open_workload(description: str):
    """A runner's start: (args, spec, torch, workload dir, device, dtype), torch set to the threads and seed."""
    args = runner_args(description)
    spec = load_spec(args.workload_dir)
    torch = setup_torch(args.threads, spec["seed"])
    return args, spec, torch, Path(args.workload_dir), spec["device"], torch_dtype(spec["dtype"])


def sync(device: str) -> None:
    """Wait for queued GPU work, so that wall-clock phase boundaries are real."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


RESULT_PREFIX = "RESULT "


def last_result(stdout: str) -> dict | None:
    """The JSON of the last `RESULT {...}` line a worker process printed, or None when it printed none."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    return json.loads(lines[-1][len(RESULT_PREFIX) :]) if lines else None


def peak_memory(device: str) -> tuple[int, str]:
    """(bytes, what was measured): peak RSS of this process on CPU, peak allocated tensor memory on GPU."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.max_memory_allocated()), "torch.cuda.max_memory_allocated"
    # ru_maxrss is in KiB on Linux
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "peak RSS"


def reset_peak_memory(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats()


class PhaseClock:
    """Per-update phase times. `mark(name)` ends the current phase at now and starts `name`."""

    def __init__(self, device: str):
        self.device = device
        self.updates: list[dict[str, float]] = []
        self._current: dict[str, float] | None = None
        self._phase: str | None = None
        self._since = 0.0

    def start_update(self) -> None:
        sync(self.device)
        self._current = {p: 0.0 for p in PHASES}
        self._current["_start"] = time.perf_counter()
        self._phase, self._since = None, self._current["_start"]

    def mark(self, phase: str | None) -> None:
        sync(self.device)
        now = time.perf_counter()
        if self._current is not None and self._phase is not None:
            self._current[self._phase] += now - self._since
        self._phase, self._since = phase, now

    def end_update(self) -> None:
        self.mark(None)
        now = time.perf_counter()
        update = self._current
        update["total_s"] = now - update.pop("_start")
        self.updates.append(update)
        self._current = None


def write_result(
    out: str | os.PathLike, *, engine: str, spec: dict, updates: list[dict], device: str, extra: dict | None = None
) -> None:
    mem, mem_kind = peak_memory(device)
    measured = updates[spec["warmup"] :]
    result = {
        "engine": engine,
        "workload": spec["name"],
        "device": device,
        "threads": None,
        "updates": measured,
        "warmup_updates": updates[: spec["warmup"]],
        "peak_memory_bytes": mem,
        "memory_kind": mem_kind,
        "samples_per_update": spec["batch_size"],
        "generated_tokens_per_update": spec["batch_size"] * spec["max_new_tokens"],
        **(extra or {}),
    }
    Path(out).write_text(json.dumps(result, indent=1))
    print(f"{engine}: {len(measured)} measured updates, peak memory {mem / 2**20:.0f} MiB", file=sys.stderr)
