"""One Prefect flow per stage of rlhfops.stages.STAGES, for the per-stage deployments (flows/serve.py): each runs
that stage alone on the outputs earlier stages left on disk, in its own MLflow parent run, with the same skipping,
concurrency limit, retries and report as the full pipeline (flows/pipeline_flow.py). They are built from the stage
list and bound as module attributes (`flows.stage_flows.ppo`, ...), so a deployment's entrypoint can import them."""

from __future__ import annotations

import inspect

from prefect import flow

from flows.pipeline_flow import FORM_SETTINGS, form_overrides, rlhf_pipeline, run_pipeline, with_overrides
from rlhflow.config.params import Config
from rlhfops.stages import STAGES, Stage
from rlhfops.tracking import flatten

# the short form's fields: the pipeline's parameters of those names, described as its docstring describes them
FORM_NAMES = {name for name, _, _ in FORM_SETTINGS}
FORM_PARAMETERS = [p for p in inspect.signature(rlhf_pipeline.fn).parameters.values() if p.name in FORM_NAMES]
FORM_DOC = "".join(
    line + "\n" for line in rlhf_pipeline.fn.__doc__.splitlines() if line.split(":")[0].strip() in FORM_NAMES
)


def stage_flow(stage: Stage):
    """The flow `rlhf-<stage>`: run_pipeline on that one stage. Its docstring describes the parameter form."""

    def run_stage(
        config: Config | None = None, force: bool = False, overrides: list[str] | None = None, **form
    ) -> dict[str, float]:
        return run_pipeline(with_overrides(config, form_overrides(form, overrides)), [stage.name], force)

    # Prefect's form and its checks read the signature: config, force, overrides, then the pipeline's form fields
    signature = inspect.signature(run_stage)
    run_stage.__signature__ = signature.replace(parameters=[*list(signature.parameters.values())[:3], *FORM_PARAMETERS])

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
        overrides: any params.yaml value, as `section.key=value` (checked as `--set` is), e.g. ["{example}"]
{FORM_DOC}    """
    return flow(name=f"rlhf-{stage.name.replace('_', '-')}", log_prints=True)(run_stage)


STAGE_FLOWS = {stage.name: stage_flow(stage) for stage in STAGES}
globals().update(STAGE_FLOWS)
