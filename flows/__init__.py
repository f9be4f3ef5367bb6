"""Prefect flows: the pipeline, sweeps, serving and restore."""

import os

# before any flow module imports prefect: the ephemeral server it starts reads these once
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

import rlhfops  # noqa: E402, F401  (a flow started by a Python without the project's stack stops here, in one line)
