"""--help's list of every params.yaml key with its value (what `--set` and a sweep's `--grid` take)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _flat_params(params: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in params.items():
        if isinstance(value, dict) and value:
            flat.update(_flat_params(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def params_epilog(load_params: Callable[[], dict]) -> str:
    """--help's list of every params.yaml key with its value there (what --set and a sweep's --grid take).
    `load_params`: reads params.yaml (the caller's loader, so that this module needs none of the config)."""
    try:
        flat = _flat_params(load_params())
    except Exception as err:  # a broken params.yaml: --help still works, and says why the list is missing
        return f"(params.yaml could not be read: {err})"
    lines = [f"  {key} = {'null' if value is None else value}" for key, value in flat.items()]
    return "params.yaml keys and their values (types, bounds, descriptions: rlhflow/config/params.py):\n" + "\n".join(
        lines
    )
