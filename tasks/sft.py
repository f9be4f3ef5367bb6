"""Stage sft: load the SFT model (Hub id, local dir, GGUF file or packaged default), optionally fine-tune it on
demonstrations with trl's SFTTrainer (`sft.train`), keep a plain safetensors copy as the stage output (the policy's
starting point and the frozen reference), and record the baseline: perplexity on held-out reference responses and a
few sample generations. A trained model is registered as `rlhf-sft`.

Demonstrations (`sft.train_data`) are read and validated (columns, blanks, token lengths: the preference data's
suite) before any training; rows whose prompt is in the test or judge split are refused. Prompts are cut as PPO cuts
them (`ppo.max_prompt_length`); demonstrations still longer than `sft.max_length` are left out, printed and logged
(`sft/dropped_overlong`), never cut."""

from __future__ import annotations

import tempfile
from pathlib import Path

from rlhflow.config.params import Config
from rlhflow.data.sources import resolve_source
from rlhflow.fsutil import atomic_dir, prepare_checkpoint_dir, remove_made
from rlhflow.training import distributed
from rlhfops.hashing import dir_md5, file_md5, inputs_fingerprint
from rlhfops.stage_runner import StageContext, cli, prints_to_stdout, stage_task

# A light door: torch, transformers, trl, peft, mlflow, pandas and great_expectations (the model, the training, the
# demonstrations' reading and suite, the tracking and registry) are imported inside the functions that use them, so
# the stage's --help and its checks answer before any of them loads.

NAME = "sft"
REGISTERED_NAME = "rlhf-sft"
HELD_OUT_SPLITS = ("test", "judge")  # evaluation's prompts and the judge's: never trained on


def checked_demonstrations(cfg: Config, tokenizer, report_dir: Path):
    """The validated demonstrations of `sft.train_data`. Raises a DataFormatError (unreadable file, missing
    columns, wrong types), a DataValidationError (blank or over-long rows beyond validate's policy, duplicates) or
    a ValueError (conversations of the test or judge split), each naming the rows."""
    from rlhflow.data.formats import load_demonstrations
    from rlhflow.data.readers import read_jsonl
    from rlhflow.data.splits import rows_sharing_conversations
    from rlhflow.data.validation import DEMONSTRATION_TEXT_COLUMNS, validate_preferences

    source = cfg.path(cfg.sft.train_data)
    validated = cfg.path(cfg.validate_.out_dir)
    held_out_files = {split: validated / f"{split}.jsonl" for split in HELD_OUT_SPLITS}
    if any(source.resolve() == f.resolve() for f in held_out_files.values()):
        raise ValueError(f"sft.train_data={cfg.sft.train_data} is a held-out split: train on the train split")
    demos = load_demonstrations(source, max_rows=cfg.validate_.max_rows)
    held_out = {split: read_jsonl(f) for split, f in held_out_files.items() if f.exists()}
    leaked = rows_sharing_conversations(demos, held_out)
    if leaked:
        where = "; ".join(
            f"{len(rows)} in a conversation of the {split} split (rows {rows[:10]})" for split, rows in leaked.items()
        )
        raise ValueError(f"{source}: demonstrations must not share conversations with held-out data: {where}")
    result = validate_preferences(
        {"demonstrations": demos},
        cfg=cfg.validate_,
        tokenizer=tokenizer,
        report_dir=report_dir,
        columns=DEMONSTRATION_TEXT_COLUMNS,
    )
    return result.kept("demonstrations", demos), result


def checkpoint_fingerprint(cfg: Config) -> str:
    """What a Trainer checkpoint must have been made from to be resumed: the same model (the md5 of its files when
    `sft.model` is a local path, which can change under the same name), training settings, prompt cut, validation
    settings (which demonstrations are kept), seed and demonstrations."""

    s = cfg.sft
    settings = s.model_dump(
        exclude={"out_dir", "checkpoint_dir", "checkpoint_every", "n_samples", "max_new_tokens", "perplexity_rows"}
    )
    model = resolve_source(s.model)  # as rlhflow.data.sources.resolve_model reads the spec
    model_md5 = None
    if model.kind in ("dir", "file"):
        model_md5 = dir_md5(model.path) if model.kind == "dir" else file_md5(model.path)
    return inputs_fingerprint(
        [cfg.path(s.train_data)],
        sft=settings,
        model_md5=model_md5,
        max_prompt_length=cfg.ppo.max_prompt_length,
        validate=cfg.validate_.model_dump(exclude={"report_dir", "examples_per_failure"}),
        seed=cfg.seed,
    )


def run(cfg: Config, ctx: StageContext) -> dict[str, float]:
    import torch

    from rlhflow.data.readers import read_jsonl
    from rlhflow.evaluation.metrics import perplexity, save_held_out_perplexity
    from rlhflow.models.loading import load_causal_lm, load_tokenizer, pick_device, save_plain
    from rlhfops import registry
    from rlhfops.serving.policy import PolicyPyfunc

    s = cfg.sft
    if s.train and distributed.world_size() > 1:  # the other processes do not run this stage: a Trainer would wait
        raise ValueError("sft.train trains in one process: run the sft stage without accelerate launch")
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(s.model, trust_remote_code=s.trust_remote_code)
    device = pick_device(cfg.device)
    test_file = cfg.path(cfg.validate_.out_dir) / "test.jsonl"
    held_out = read_jsonl(test_file).drop_duplicates("prompt").head(s.perplexity_rows)

    def held_out_perplexity(model) -> float:
        model.to(device).eval()
        return perplexity(
            model, tokenizer, list(held_out["prompt_messages"]), list(held_out["chosen"]), batch_size=s.batch_size
        )

    metrics: dict[str, float] = {}
    dataset = None
    if s.train:  # the demonstrations are checked before anything is loaded or trained
        dataset, metrics = demonstrations(cfg, tokenizer)
    model = load_causal_lm(s.model, trust_remote_code=s.trust_remote_code, pad_token_id=tokenizer.pad_token_id)
    out_dir = cfg.path(s.out_dir)
    with atomic_dir(out_dir, setting="sft.out_dir") as tmp:
        save_plain(model, tokenizer, tmp)
        if s.train:
            # a GGUF-loaded model: the Trainer can neither train nor save it, so train the plain copy just saved
            if getattr(model, "hf_quantizer", None) is not None:
                model = load_causal_lm(str(tmp), pad_token_id=tokenizer.pad_token_id)
            metrics["sft/perplexity_before"] = held_out_perplexity(model)
            model = fine_tune(cfg, ctx, model, tokenizer, dataset)
            save_plain(model, tokenizer, tmp)
        # the baseline figure, saved with the model: evaluate reads it for the same rows instead of measuring again
        metrics["sft/perplexity"] = held_out_perplexity(model)
        save_held_out_perplexity(tmp, metrics["sft/perplexity"], rows=s.perplexity_rows, data_file=test_file)

    metrics["sft/parameters"] = float(sum(p.numel() for p in model.parameters()))
    if s.n_samples:
        log_samples(cfg, model, tokenizer, held_out.head(s.n_samples))
    ctx.log_metrics(metrics)
    registry.log_model_dir(
        cfg, out_dir, name="sft_model", wrapper=PolicyPyfunc, registered_name=REGISTERED_NAME if s.train else None
    )
    if s.train:
        remove_made(cfg.path(s.checkpoint_dir))  # logged and registered: nothing left to resume
    return metrics


def demonstrations(cfg: Config, tokenizer):
    """The checked demonstrations as trl's dataset, with what was kept and left out: (dataset, metrics)."""
    import mlflow

    from rlhflow.training.sft import demonstration_dataset
    from rlhfops import tracking

    s = cfg.sft
    with tempfile.TemporaryDirectory() as report_dir:
        try:
            demos, checked = checked_demonstrations(cfg, tokenizer, Path(report_dir))
        finally:
            mlflow.log_artifacts(report_dir, artifact_path="demonstrations_validation")
    metrics = {"sft/demonstrations": float(len(demos)), "sft/demonstrations_dropped": float(checked.dropped_rows)}
    dataset, overlong = demonstration_dataset(
        demos, tokenizer, max_prompt_length=cfg.ppo.max_prompt_length, max_length=s.max_length
    )
    print(
        f"sft: {overlong} of {len(demos)} demonstrations left out: longer than sft.max_length={s.max_length} "
        f"tokens with the prompt cut to ppo.max_prompt_length={cfg.ppo.max_prompt_length}"
    )
    metrics["sft/dropped_overlong"] = float(overlong)
    if cfg.path(s.train_data).suffix in (".jsonl", ".parquet"):
        tracking.log_dataset(cfg.path(s.train_data), name="sft-demonstrations", context="training")
    return dataset, metrics


def fine_tune(cfg: Config, ctx: StageContext, model, tokenizer, dataset):
    """trl's SFTTrainer on the demonstrations, resuming a checkpoint of the same inputs; the trained model."""
    from rlhflow.training.sft import sft_trainer, train_sft

    checkpoint_dir = prepare_checkpoint_dir(
        cfg.path(cfg.sft.checkpoint_dir), checkpoint_fingerprint(cfg), setting="sft.checkpoint_dir"
    )

    def log_fn(m: dict, step: int) -> None:
        ctx.log_metrics({f"sft/{k}": v for k, v in m.items()}, step=step)

    with prints_to_stdout():  # trl prepares the demonstrations here (labels, packing)
        trainer = sft_trainer(cfg.sft, model, tokenizer, dataset, work_dir=checkpoint_dir, seed=cfg.seed, log_fn=log_fn)
    return train_sft(trainer, log_fn=log_fn)


def log_samples(cfg: Config, model, tokenizer, rows) -> None:
    """A few answers of the model to held-out prompts, as an MLflow table."""
    import mlflow

    outs = sample_settings(cfg).sample(model, tokenizer, list(rows["prompt_messages"]))
    responses = [t for o in outs for t in o.texts]
    mlflow.log_table({"prompt": list(rows["prompt"]), "response": responses}, artifact_file="sft_samples.json")


def sample_settings(cfg: Config):
    """The SFT model's sample answers: as PPO samples (its prompt cut, top-k / top-p, stop strings), at the
    evaluation temperature, with the run's seed."""
    from rlhflow.models.sampling import Sampling

    return Sampling(
        temperature=cfg.eval_temperature,
        top_k=cfg.ppo.top_k,
        top_p=cfg.ppo.top_p,
        repetition_penalty=1.0,
        max_new_tokens=cfg.sft.max_new_tokens,
        max_prompt_length=cfg.ppo.max_prompt_length,
        stop_strings=tuple(cfg.ppo.stop_strings),
        seed=cfg.seed,
        batch_size=cfg.sft.batch_size,
        kv_cache=cfg.ppo.kv_cache,
    )


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
