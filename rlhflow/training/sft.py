"""Supervised fine-tuning on demonstrations with trl's SFTTrainer (docs/sft.md).

Loss, completion tokens only (prompt tokens labelled -100):
    L = -(1 / sum |y|) * sum_(x, y) sum_t log pi(y_t | x, y_<t)
The prompt is rendered and cut as the policy is prompted later (rlhflow.models.policy). No completion is cut: a
demonstration longer than `sft.max_length` is left out and counted. With LoRA (`sft.lora.enabled`) the adapter is
merged before the model is returned, so the saved model is a plain one of the loaded architecture.
"""

from __future__ import annotations

# trl, peft and datasets are imported by the functions that train: importing this module stays light.
import os

import pandas as pd
import torch

from rlhflow.config.params import SFTConfig
from rlhflow.models.loading import pick_device, trainer_bf16
from rlhflow.models.policy import prompt_ids, prompt_text
from rlhflow.training.hf_trainer import LogFn, checkpoint_args, log_callback, train_resuming, trl_alias_warning_off

LOGGING_STEPS = 5


def completion_text(tokenizer, prompt_messages: list[dict], completion: str) -> str:
    """The text that follows the prompt (as `policy.prompt_text` renders it) in a demonstration: with a chat template
    the assistant's turn as the template writes it (its end of turn included), else the completion and EOS."""
    head, _ = prompt_text(tokenizer, prompt_messages)
    if getattr(tokenizer, "chat_template", None):
        full = tokenizer.apply_chat_template(
            prompt_messages + [{"role": "assistant", "content": completion}], tokenize=False
        )
    else:
        full = head + completion + (tokenizer.eos_token or "")
    return full[len(os.path.commonprefix([head, full])) :]


def demonstration_dataset(demos: pd.DataFrame, tokenizer, *, max_prompt_length: int, max_length: int):
    """TRL's tokenized prompt/completion dataset (input_ids, completion_mask; the loss is on the completion) and the
    number of demonstrations left out. The prompt is cut as PPO cuts it (`policy.prompt_ids`: its last
    `max_prompt_length` tokens); a demonstration still longer than `max_length` is left out, never cut: a cut
    completion would teach the model to stop without its end."""
    from datasets import Dataset

    rows: dict[str, list] = {"input_ids": [], "completion_mask": []}
    dropped = 0
    for messages, completion in zip(demos["prompt_messages"], demos["completion"]):
        prompt = prompt_ids(tokenizer, messages, max_prompt_length)
        answer = tokenizer(completion_text(tokenizer, messages, completion), add_special_tokens=False)["input_ids"]
        if len(prompt) + len(answer) > max_length:
            dropped += 1
            continue
        rows["input_ids"].append(prompt + list(answer))
        rows["completion_mask"].append([0] * len(prompt) + [1] * len(answer))
    if not rows["input_ids"]:
        raise ValueError(
            f"none of the {len(demos)} demonstrations fits sft.max_length={max_length} tokens "
            f"(prompts cut to ppo.max_prompt_length={max_prompt_length})"
        )
    return Dataset.from_dict(rows), dropped


def sft_trainer(cfg: SFTConfig, model, tokenizer, dataset, *, work_dir: str | os.PathLike, seed: int, log_fn=None):
    """trl's SFTTrainer for `model` on a `demonstration_dataset`, with the loss on completion tokens only, checkpoints
    into `work_dir` every `cfg.checkpoint_every` steps."""
    from trl import SFTConfig as TrainerConfig
    from trl import SFTTrainer

    peft_config = cfg.lora.peft_config(task_type="CAUSAL_LM") if cfg.lora.enabled else None
    args = TrainerConfig(
        output_dir=str(work_dir),
        num_train_epochs=cfg.epochs,
        per_device_train_batch_size=cfg.train_batch_size,
        learning_rate=cfg.learning_rate,
        lr_scheduler_type="linear",
        max_length=cfg.max_length,
        packing=cfg.packing,
        completion_only_loss=True,
        activation_checkpointing=False,  # trl's default on: ~30% slower steps, needed only for large models
        logging_steps=LOGGING_STEPS,
        report_to="none",
        seed=seed,
        **checkpoint_args(cfg.checkpoint_every),
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        bf16=trainer_bf16(cfg.precision, pick_device(), "sft"),  # auto: fp32 on CPUs (TRAINER_BF16_ON_CPU)
        disable_tqdm=False,
    )
    torch.manual_seed(seed)  # the LoRA adapter's initialisation
    with trl_alias_warning_off():
        return SFTTrainer(
            model=model,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=peft_config,
            callbacks=[log_callback(log_fn)],
        )


def train_sft(trainer, *, log_fn: LogFn | None = None):
    """Train with an `sft_trainer`, resuming from the last complete checkpoint in its output dir (kept by the caller
    only for the same inputs: `rlhflow.fsutil.prepare_checkpoint_dir`). Returns the trained model, a LoRA adapter
    merged in, in eval mode."""
    train_resuming(trainer, trainer.args.output_dir, what="sft", log_fn=log_fn)
    if log_fn:
        log_fn(
            {"train_steps": float(trainer.state.global_step), "train_sequences": float(len(trainer.train_dataset))},
            trainer.state.global_step,
        )
    trained = trainer.model
    if hasattr(trained, "merge_and_unload"):  # a LoRA adapter
        trained = trained.merge_and_unload()  # W + (alpha / r) B A: a plain model again
    return trained.eval()
