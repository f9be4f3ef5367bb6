"""Stage demo_data: write the deterministic demo preference data (`data.demo` params)."""

from __future__ import annotations

from rlhflow.config.params import Config
from rlhflow.data.demo import write_demo
from rlhfops.stage_runner import StageContext, cli, stage_task

NAME = "demo_data"


def run(cfg: Config, ctx: StageContext) -> dict[str, float]:
    path = write_demo(cfg.data.demo, cfg.path(cfg.data.demo.out_dir))
    rows = sum(1 for _ in open(path))
    return {"demo/pairs": rows}


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
