"""One Prefect flow per stage of rlhfops.stages.STAGES, for the per-stage deployments (flows/serve.py): each runs
that stage alone on the outputs earlier stages left on disk, in its own MLflow parent run, with the same skipping,
concurrency limit, retries and report as the full pipeline (flows/pipeline_flow.py). They are built from the stage
list and bound as module attributes (`flows.stage_flows.ppo`, ...), so a deployment's entrypoint can import them."""

from __future__ import annotations

from prefect import flow

from flows.pipeline_flow import run_pipeline, with_overrides
from rlhflow.config.params import Config
from rlhfops.stages import STAGES, Stage
from rlhfops.tracking import flatten


def stage_flow(stage: Stage):
    """The flow `rlhf-<stage>`: run_pipeline on that one stage. Its docstring describes the parameter form."""

    def run_stage(
        config: Config | None = None, force: bool = False, overrides: list[str] | None = None
    ) -> dict[str, float]:
        return run_pipeline(with_overrides(config, overrides), [stage.name], force)

    # the stage's own params section (or data's), else the section of its first param (sft_answers: evaluate's)
    own = (p for p in stage.params if p.split(".")[0] == stage.name or p.startswith("data."))
    section = next(own, stage.params[0].split(".")[0])
    example = next(f"{k}={v}" for k, v in flatten(Config().to_params()).items() if k.startswith(section + "."))
    run_stage.__name__ = run_stage.__qualname__ = stage.name
    run_stage.__module__ = __name__
    run_stage.__doc__ = f"""The {stage.name} stage alone: {stage.description}.

    Args:
        config: every hyperparameter (params.yaml; its values are the defaults)
        force: run even when the stage is up to date
        overrides: params.yaml overrides applied on top of `config`, e.g. ["{example}"]
    """
    return flow(name=f"rlhf-{stage.name.replace('_', '-')}", log_prints=True)(run_stage)


STAGE_FLOWS = {stage.name: stage_flow(stage) for stage in STAGES}
globals().update(STAGE_FLOWS)
