"""Stage sft_answers: the SFT model's answers to the evaluation prompts (one per test conversation), sampled once
with the evaluation's settings, classified (ended / cut / degenerate) and scored by the proxy and the judge. Every
evaluate of a policy, and every point of a sweep, compares against these same answers: they change only with the
SFT model, the test split, the sampling settings, the proxy or the judge (rlhflow/evaluation/held_out.py)."""

from __future__ import annotations

from rlhflow.config.params import Config
from rlhflow.evaluation.held_out import REFERENCE_FILE, HeldOutPrompts, reference_record, sample_reference
from rlhflow.fsutil import atomic_dir, write_json_atomic
from rlhflow.models.loading import pick_device
from rlhfops.stage_runner import StageContext, cli, stage_task
from tasks.evaluation_setup import (
    evaluation_settings,
    held_out_split_files,
    load_evaluation_judge,
    load_proxy,
    sft_answers_key,
    sft_in_precision,
)

NAME = "sft_answers"


def run(cfg: Config, ctx: StageContext) -> dict[str, float]:
    settings = evaluation_settings(cfg)
    device = pick_device(cfg.device)
    files = held_out_split_files(cfg)
    held_out = HeldOutPrompts.load(files, settings.n_prompts, settings.samples_per_prompt)
    tokenizer, sft = sft_in_precision(cfg, settings.precision, device)
    answers = sample_reference(settings, sft, tokenizer, held_out)
    del sft  # the scorers load next
    rm, judge = load_proxy(cfg.path(cfg.reward_model.out_dir), cfg, device), load_evaluation_judge(cfg, device)
    key = sft_answers_key(settings, held_out, files, cfg.path(cfg.sft.out_dir))
    record, metrics = reference_record(answers, rm, judge, held_out, key)
    with atomic_dir(cfg.path(cfg.evaluate.reference_dir), setting="evaluate.reference_dir") as tmp:
        write_json_atomic(tmp / REFERENCE_FILE, record)
    ctx.log_metrics(metrics)
    return metrics


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
