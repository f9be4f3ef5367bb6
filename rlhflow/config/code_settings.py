"""Settings that run code: allowed by the environment of the command, never by params.yaml alone.

params.yaml and `--set` may come from someone else (a pull request, a parameter typed into the Prefect UI). A setting
that makes a stage run Python that the pipeline does not ship runs it with the credentials of the machine, so such a
setting takes effect only when the variable RLHFLOW_ALLOW_CODE of the command's environment names it (settings
separated by commas): something a params file cannot set.

- `sft.trust_remote_code: true` runs the Python files that come with the models the stages load (the SFT model, its
  tokenizer, the reward model's and judge's backbones) as soon as a stage loads one;
- `ppo.reward_fn` naming a module other than the shipped rlhflow.ppo.reward_functions imports and calls it;
- `launch.accelerate_config` naming a file outside the shipped configs/accelerate/: `accelerate launch` copies its
  sections onto its own and torchrun's arguments (a rendezvous backend and its endpoint, a DeepSpeed config, a
  launcher), and such arguments load code and unpickle files.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ALLOW_CODE_VARIABLE = "RLHFLOW_ALLOW_CODE"
SHIPPED_REWARD_FUNCTIONS = "rlhflow.ppo.reward_functions"
SHIPPED_ACCELERATE_CONFIGS = "configs/accelerate"  # relative to the project root
CODE_SETTINGS = ("sft.trust_remote_code", "ppo.reward_fn", "launch.accelerate_config")


def code_in_use(cfg: Any) -> dict[str, str]:
    """{setting: what it runs} for each setting of `cfg` that runs code the pipeline does not ship."""
    found = {}
    if cfg.sft.trust_remote_code:
        models = ", ".join(f"{key}={value!r}" for key, value in models_loaded(cfg).items())
        found["sft.trust_remote_code"] = f"the Python files that come with the models it loads ({models})"
    module = (cfg.ppo.reward_fn or "").partition(":")[0]
    if module and module != SHIPPED_REWARD_FUNCTIONS:
        found["ppo.reward_fn"] = f"the module {module!r}, imported and called"
    if cfg.launch.accelerate_config and not shipped_accelerate_config(cfg.path(cfg.launch.accelerate_config), cfg):
        found["launch.accelerate_config"] = (
            f"what accelerate and torchrun make of {cfg.launch.accelerate_config!r}, a file outside the shipped "
            f"{SHIPPED_ACCELERATE_CONFIGS}/ (its sections become their arguments)"
        )
    return found


def shipped_accelerate_config(path: Path, cfg: Any) -> bool:
    """Whether `path`, its links resolved, is a file of the project's own configs/accelerate/."""
    return path.resolve().is_relative_to(cfg.path(SHIPPED_ACCELERATE_CONFIGS).resolve())


def models_loaded(cfg: Any) -> dict[str, str]:
    """The settings naming models whose code `sft.trust_remote_code` lets run."""
    return {
        "sft.model": cfg.sft.model,
        "reward_model.backbone": cfg.reward_model.backbone,
        "judge.backbone": cfg.judge.backbone,
    }


def allowed_settings(environ: Mapping[str, str] = os.environ) -> set[str]:
    """The settings RLHFLOW_ALLOW_CODE names; a name that is no setting that runs code is refused (a typo would
    otherwise leave the user wondering why their allowance does nothing)."""
    named = {name.strip() for name in environ.get(ALLOW_CODE_VARIABLE, "").split(",") if name.strip()}
    unknown = sorted(named - set(CODE_SETTINGS))
    if unknown:
        raise ValueError(
            f"${ALLOW_CODE_VARIABLE} names {', '.join(map(repr, unknown))}, which is no setting that runs code "
            f"(those are {', '.join(CODE_SETTINGS)})"
        )
    return named


def refusal(cfg: Any, environ: Mapping[str, str] = os.environ) -> str | None:
    """Why `cfg` may not run (None: it may): each setting that runs code and that the environment does not allow."""
    allowed = allowed_settings(environ)
    refused = {setting: what for setting, what in code_in_use(cfg).items() if setting not in allowed}
    if not refused:
        return None
    lines = [f"{setting} runs {what}" for setting, what in refused.items()]
    return (
        "; ".join(lines) + ". A params file or --set (a pull request, a Prefect parameter) cannot turn on code that "
        f"runs with this machine's credentials: allow it in the command's environment, e.g. "
        f"{ALLOW_CODE_VARIABLE}={','.join(refused)} python -m flows.pipeline ..."
    )
