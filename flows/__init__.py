"""Prefect flows: the pipeline, sweeps, serving and restore. Each command module (`flows/<name>.py`) parses its
command line and hands the rest of its names on from its flow module (`flows/<name>_flow.py`, `handed_on`)."""

import argparse
import importlib
import os
import sys

# before any flow module imports prefect: the ephemeral server it starts reads these once
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

import rlhfops  # noqa: E402, F401  (a flow started by a Python without the project's stack stops here, in one line)
from rlhfops.stages import STAGE_NAMES  # noqa: E402
from rlhfops.temporary_server import start_temporary_server  # noqa: E402


def handed_on(command: str, flow_module: str):
    """A module `__getattr__` (PEP 562) for the command module `command`: the names it lacks (its flows, their tasks
    and helpers) come from `flow_module`, imported at first use, so `from flows.pipeline import rlhf_pipeline` and an
    entrypoint `flows/pipeline.py:rlhf_pipeline` give the flow while the command's --help loads none of it."""

    def __getattr__(name: str):
        if name.startswith("__"):  # a probe for a module dunder (__path__, __wrapped__, ...) loads nothing
            raise AttributeError(f"module {command!r} has no attribute {name!r}")
        return getattr(importlib.import_module(flow_module), name)

    return __getattr__


def add_stages_option(parser: argparse.ArgumentParser) -> None:
    """`--stages a,b`: the subset of stages a pipeline command runs (flows.pipeline, flows.team run)."""
    parser.add_argument(
        "--stages", default=None, help=f"comma-separated subset of stages to run: {', '.join(STAGE_NAMES)}"
    )


def flow_exit_status(call, refused: type[Exception], failed: str) -> int:
    """A command's exit status for `call()` (its flow, on a temporary Prefect server unless one is configured): 0, or
    1 with "<failed>: <why>" on stderr when the flow raises `refused`, the error its command names without a
    traceback."""
    try:
        start_temporary_server()
        call()
    except refused as err:
        print(f"{failed}: {err}", file=sys.stderr)
        return 1
    return 0
