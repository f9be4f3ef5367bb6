"""Stage demo_data: write the deterministic demo preference data (`data.demo` params)."""

from __future__ import annotations

# Heavy imports (torch, transformers, mlflow, the library's model code) are deferred into the stage body, so
# that importing the module (the flow does, to get its task; so does `--help`) stays fast.
from rlhflow.config.params import Config
from rlhfops.stage_runner import StageContext, cli, stage_task

NAME = "demo_data"


def run(cfg: Config, ctx: StageContext) -> dict[str, float]:
    from rlhflow.data.demo import write_demo

    path = write_demo(cfg.data.demo, cfg.path(cfg.data.demo.out_dir))
    rows = sum(1 for _ in open(path))
    return {"demo/pairs": rows}


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
