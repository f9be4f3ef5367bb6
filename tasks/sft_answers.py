"""Stage sft_answers: the SFT model's answers to the evaluation prompts (one per test conversation, and one per dev
conversation with evaluate.dev_figures), sampled once with the evaluation's settings, classified (ended / cut /
degenerate) and scored by the proxy and the judge. Every evaluate of a policy, and every point of a sweep, compares
against these same answers: they change only with the SFT model, the held-out splits, the sampling settings, the
proxy or the judge (rlhflow/evaluation/held_out.py)."""

from __future__ import annotations

from rlhflow.config.params import Config
from rlhflow.fsutil import atomic_dir, write_json_atomic
from rlhfops.stage_runner import StageContext, cli, stage_task
from tasks.evaluation_setup import (
    evaluation_inputs,
    load_evaluation_judge,
    sft_answers_key,
    sft_in_precision,
)

# A light door: torch, transformers and pandas (the models, the held-out prompts) are imported inside run, so the
# stage's --help and its checks answer before any of them loads.

NAME = "sft_answers"


def run(cfg: Config, ctx: StageContext) -> dict[str, float]:
    from rlhflow.evaluation.held_out import (
        REFERENCE_FILE,
        HeldOutPrompts,
        held_out_files,
        reference_record,
        sample_answers,
    )
    from rlhflow.models.loading import pick_device
    from rlhflow.progress import ProgressLines
    from rlhflow.training.reward_model import RewardModel

    inputs = evaluation_inputs(cfg)  # the stage's reading of params.yaml; what follows uses these values
    settings, files = inputs.settings, held_out_files(inputs.validated_dir)
    device = pick_device(inputs.device)
    held_out = HeldOutPrompts.load(files, settings.n_prompts, settings.samples_per_prompt)
    tokenizer, sft = sft_in_precision(inputs.sft_dir, settings.precision, device)
    _, answers = sample_answers(settings, sft, tokenizer, held_out, lines=ProgressLines(NAME))
    del sft  # the scorers load next
    rm = RewardModel.load(inputs.proxy_dir, batch_size=inputs.proxy_batch_size, device=device)
    judge = load_evaluation_judge(inputs, device)
    key = sft_answers_key(settings, held_out, files, inputs.sft_dir)
    record, metrics = reference_record(answers, rm, judge, held_out, key)
    with atomic_dir(inputs.reference_dir, setting="evaluate.reference_dir") as tmp:
        write_json_atomic(tmp / REFERENCE_FILE, record)
    ctx.log_metrics(metrics)
    return metrics


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
