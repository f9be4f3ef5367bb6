"""Policy optimisation with trl: GRPO, RLOO and DPO as drop-in alternatives to the project's PPO engine, chosen by
`align.algorithm` (tasks/ppo.py dispatches here for every algorithm but `ppo`). GRPO and RLOO sample from the
train split's prompts as PPO samples and optimise PPO's reward source (`ProxyReward`, with the missing-EOS
penalty); DPO trains on its preference pairs against the frozen SFT model (`truncating_collator`). All three
resume from Trainer checkpoints in `ppo.checkpoint_dir` and log `align/<name>` (`align_metrics`).
The algorithms and their settings: docs/alignment.md.
"""

from __future__ import annotations

# trl, datasets and transformers' Trainer pieces (which load peft) are imported by the functions that need them:
# `import rlhflow.training.align` stays light.
import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from transformers import GenerationConfig

from rlhflow.config.align import AlignConfig
from rlhflow.config.ppo import PPOConfig
from rlhflow.models.generation import stop_token_ids
from rlhflow.models.loading import trainer_bf16
from rlhflow.models.policy import prompt_ids, prompt_text
from rlhflow.training import distributed
from rlhflow.training.hf_trainer import checkpoint_args, train_resuming

LogFn = Callable[[dict, int], None]  # (metrics, step)
PREFIX = "align/"
SCORED_DIR = "scored"  # in the checkpoint dir: one parquet file per step of what ProxyReward scored
# trl's names of the statistics it logs -> ours (under align/); the rest keep trl's name
RENAMED = {"completions/mean_length": "completion_length", "learning_rate": "lr"}
SAMPLING_ALGORITHMS = ("grpo", "rloo")
REWARD_NAME = "proxy"  # trl names the reward's statistics (rewards/proxy/mean) and table column after it


# ---- settings ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AlignSettings:
    """What trl's algorithms read: the align section, PPO's sampling and reward settings (the contract they share
    with PPO) and the training seed."""

    align: AlignConfig
    ppo: PPOConfig
    seed: int


def preference_pairs(rows: Sequence[dict]) -> list[dict]:
    """The rows DPO learns from: a chosen and a rejected response that differ."""
    return [
        r
        for r in rows
        if isinstance(r.get("chosen"), str)
        and isinstance(r.get("rejected"), str)
        and r["chosen"].strip()
        and r["rejected"].strip()
        and r["chosen"] != r["rejected"]
    ]


def unique_prompts(rows: Sequence[dict]) -> list[list[dict]]:
    """Each distinct prompt of the rows once, as chat messages, in order (the prompts PPO samples from)."""
    seen, prompts = set(), []
    for r in rows:
        if r.get("prompt") not in seen:
            seen.add(r.get("prompt"))
            prompts.append(list(r["prompt_messages"]))
    return prompts


def check_settings(settings: AlignSettings, train_rows: Sequence[dict], tokenizer=None) -> None:
    """Settings that the typed config cannot judge alone fail here, before any model is loaded, naming the key."""
    algorithm = settings.align.algorithm
    if algorithm == "dpo" and not preference_pairs(train_rows):
        raise ValueError(
            f"align.algorithm=dpo needs preference pairs, and the train split ({len(train_rows)} rows) has none with "
            "a chosen and a different rejected response; use align.algorithm=ppo, grpo or rloo (they need prompts "
            "only) or preference data"
        )
    if algorithm in SAMPLING_ALGORITHMS:
        if not unique_prompts(train_rows):
            raise ValueError(f"align.algorithm={algorithm}: the train split has no prompts to sample from")
        if tokenizer is not None:
            vocab = tokenizer.get_vocab()
            multi_token = [s for s in settings.ppo.stop_strings if s not in vocab]
            if multi_token:
                raise ValueError(
                    f"ppo.stop_strings {multi_token}: align.algorithm={algorithm} stops only at EOS and stop strings "
                    "that are single tokens of the vocabulary (trl samples); remove them or use align.algorithm=ppo"
                )


# ---- the reward ----------------------------------------------------------------------------------


def _completion_text(completion: Any) -> str:
    """trl hands conversational completions as [{"role": "assistant", "content": ...}], plain ones as text."""
    if isinstance(completion, list):
        return "".join(m.get("content", "") for m in completion if isinstance(m, dict))
    return str(completion)


def _messages(prompt: Any) -> list[dict]:
    return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


def render_messages(messages: Sequence[dict]) -> str:
    """A conversation as plain text for tables: one `role: content` paragraph per message."""
    return "\n\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in messages)


class ProxyReward:
    """A trl reward function (GRPOTrainer, RLOOTrainer) that scores as PPO scores its rollouts: `score_fn` (the
    proxy reward model's normalised score of the decoded prompt and completion text, or `ppo.reward_fn`) minus
    `missing_eos_penalty` for completions that ended neither with EOS nor a single-token stop string.

    Logs `score_mean` (before the penalty) and `eos_fraction` through trl's `log_metric`, and each completion's
    `score` and `ended` as columns of trl's completions table (`log_extra`); with `record_dir`, writes what it scored
    (prompt, completion, score, reward, ended) to `record_dir/step_NNNNN.parquet` on the main process."""

    __name__ = REWARD_NAME  # what trl calls the reward function (an instance's name; the class keeps its own)

    def __init__(
        self,
        score_fn: Callable[[list, list[str]], Any],
        *,
        eos_ids: Sequence[int],
        missing_eos_penalty: float | None,
        record_dir: str | Path | None = None,
    ):
        self.score_fn = score_fn
        self.eos_ids = set(eos_ids)
        self.missing_eos_penalty = missing_eos_penalty or 0.0
        self.record_dir = Path(record_dir) if record_dir is not None else None

    def __call__(
        self,
        prompts: list,
        completions: list,
        completion_ids: list[list[int]] | None = None,
        trainer_state=None,
        log_metric: Callable[[str, float], None] | None = None,
        log_extra: Callable[[str, list], None] | None = None,
        **_: Any,
    ) -> list[float]:
        messages = [_messages(p) for p in prompts]
        texts = [_completion_text(c) for c in completions]
        scores = [float(s) for s in torch.as_tensor(self.score_fn(messages, texts), dtype=torch.float32).flatten()]
        if len(scores) != len(texts):
            raise ValueError(f"the reward source returned {len(scores)} scores for {len(texts)} completions")
        step = (trainer_state.global_step if trainer_state is not None else 0) + 1  # the step this batch trains
        if not all(math.isfinite(s) for s in scores):
            raise FloatingPointError(f"non-finite reward at step {step}; no checkpoint was written for it")
        if completion_ids is None:
            ended = [True] * len(texts)
        else:
            ended = [bool(ids) and int(ids[-1]) in self.eos_ids for ids in completion_ids]
        rewards = [s - self.missing_eos_penalty * (not e) for s, e in zip(scores, ended)]
        if log_metric is not None:
            log_metric("score_mean", sum(scores) / len(scores))
            log_metric("eos_fraction", sum(ended) / len(ended))
        if log_extra is not None:  # columns of trl's completions table (GRPO's completions/*.parquet)
            log_extra("score", scores)
            log_extra("ended", ended)
        if self.record_dir is not None and distributed.is_main_process():
            self.record_dir.mkdir(parents=True, exist_ok=True)
            table = {
                "step": [step] * len(texts),
                "prompt": [render_messages(m) for m in messages],
                "completion": texts,
                "score": scores,
                "reward": rewards,
                "ended": ended,
            }
            pd.DataFrame(table).to_parquet(self.record_dir / f"step_{step:05d}.parquet")
        return rewards


# ---- prompts and pairs as PPO sees them ----------------------------------------------------------


class PPOPrompts:
    """Mixed into trl's GRPOTrainer / RLOOTrainer: prompts are tokenised as PPO tokenises them
    (`rlhflow.models.policy.prompt_ids`), left-truncated to `max_prompt_length` (trl 1.16 has no prompt length
    limit)."""

    max_prompt_length: int = 192

    def _tokenize_prompts(self, prompts: list):
        ids = [prompt_ids(self.processing_class, list(_messages(p)), self.max_prompt_length) for p in prompts]
        return ids, None, {}


def _with_ppo_prompts(trainer_class, max_prompt_length: int):
    if not hasattr(trainer_class, "_tokenize_prompts"):  # the hook PPOPrompts overrides (trl 1.16)
        raise RuntimeError(f"this trl's {trainer_class.__name__} has no _tokenize_prompts to cut prompts with")
    return type(trainer_class.__name__, (PPOPrompts, trainer_class), {"max_prompt_length": max_prompt_length})


def prompt_dataset(rows: Sequence[dict]):
    """The train split's distinct prompts as trl's conversational prompt dataset."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": unique_prompts(rows)})


def preference_dataset(rows: Sequence[dict], tokenizer):
    """The train split's pairs as trl's preference dataset: conversational (trl applies the chat template) when the
    tokenizer has one, else PPO's plain-text prompt with each response after a space."""
    from datasets import Dataset

    pairs = preference_pairs(rows)
    if getattr(tokenizer, "chat_template", None):
        return Dataset.from_dict(
            {
                "prompt": [list(r["prompt_messages"]) for r in pairs],
                "chosen": [[{"role": "assistant", "content": r["chosen"]}] for r in pairs],
                "rejected": [[{"role": "assistant", "content": r["rejected"]}] for r in pairs],
            }
        )
    return Dataset.from_dict(
        {
            "prompt": [prompt_text(tokenizer, list(r["prompt_messages"]))[0] for r in pairs],
            "chosen": [" " + r["chosen"] for r in pairs],
            "rejected": [" " + r["rejected"] for r in pairs],
        }
    )


def truncating_collator(pad_token_id: int, max_prompt_length: int, max_response_length: int):
    """trl's preference collator, each prompt cut to its last `max_prompt_length` tokens and each response to its
    first `max_response_length` before padding."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    class TruncatingCollator(DataCollatorForPreference):
        def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
            cut = [
                {
                    **ex,
                    "prompt_ids": list(ex["prompt_ids"])[-max_prompt_length:],
                    "chosen_ids": list(ex["chosen_ids"])[:max_response_length],
                    "rejected_ids": list(ex["rejected_ids"])[:max_response_length],
                }
                for ex in examples
            ]
            return super().torch_call(cut)

    return TruncatingCollator(pad_token_id=pad_token_id)


# ---- trainer arguments ---------------------------------------------------------------------------


def _common_args(settings: AlignSettings, device: torch.device, work_dir: str | Path) -> dict[str, Any]:
    """What every trl algorithm's config shares: the align section's run length, batch, learning rate, checkpoints
    and precision."""
    a = settings.align
    return dict(
        output_dir=str(work_dir),
        max_steps=a.steps,
        per_device_train_batch_size=distributed.shard_size(a.batch_size, "align.batch_size"),
        gradient_accumulation_steps=1,
        learning_rate=a.learning_rate,
        lr_scheduler_type="constant" if a.lr_schedule == "constant" else "linear",
        warmup_steps=0,
        logging_steps=1,
        report_to="none",
        seed=settings.seed,
        **checkpoint_args(a.checkpoint_every),
        use_cpu=device.type != "cuda",
        bf16=device.type == "cuda" and trainer_bf16(a.precision, device, "align"),
        fp16=False,
        activation_checkpointing=a.gradient_checkpointing,  # transformers 5 name (gradient_checkpointing: deprecated)
        disable_dropout=True,
        dataloader_num_workers=0,
        disable_tqdm=not distributed.is_main_process(),
    )


def trainer_args(settings: AlignSettings, device: torch.device, work_dir: str | Path):
    """The GRPOConfig, RLOOConfig or DPOConfig of `align.algorithm`: the align section's shared settings and the
    algorithm's own, PPO's sampling settings, fp32 unless on CUDA with bf16 asked for (align.precision), no
    gradient checkpointing unless asked for, a log entry every step."""
    a, p = settings.align, settings.ppo
    common = _common_args(settings, device, work_dir)
    sampling = dict(
        max_completion_length=p.max_new_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        repetition_penalty=1.0,
        remove_unused_columns=False,
        steps_per_generation=a.steps_per_generation,
        num_iterations=1,
        mask_truncated_completions=False,
    )
    if a.algorithm == "grpo":
        from trl import GRPOConfig

        g = a.grpo
        return GRPOConfig(
            **common,
            **sampling,
            num_generations=g.num_generations,
            beta=g.beta,
            loss_type=g.loss_type,
            scale_rewards=g.scale_rewards,
            epsilon=g.epsilon,
            importance_sampling_level="sequence" if g.loss_type == "luspo" else "token",
            log_completions=True,  # output_dir/completions/completions_<step>.parquet, logged to MLflow at the end
            num_completions_to_print=0,
        )
    if a.algorithm == "rloo":
        from trl import RLOOConfig

        return RLOOConfig(**common, **sampling, num_generations=a.rloo.num_generations, beta=a.rloo.beta)
    if a.algorithm == "dpo":
        from trl import DPOConfig

        d = a.dpo
        return DPOConfig(
            **common,
            beta=d.beta,
            loss_type=[d.loss_type],
            label_smoothing=d.label_smoothing,
            max_length=None,  # the collator cuts prompts and responses apart (truncating_collator)
        )
    raise ValueError(f"align.algorithm={a.algorithm} is not a trl algorithm")


# ---- logging -------------------------------------------------------------------------------------


def align_metrics(logs: dict[str, Any]) -> dict[str, float]:
    """A trl log entry as our metrics: every number under align/ (`completions/mean_length` as
    `completion_length`, `learning_rate` as `lr`), step and epoch left out."""
    out = {}
    for key, value in logs.items():
        if key in ("step", "epoch") or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[PREFIX + RENAMED.get(key, key)] = float(value)
    return out


def _is_step_entry(entry: dict[str, Any]) -> bool:
    return "step" in entry and "train_runtime" not in entry  # the end-of-training summary is not a step


def history_of(log_history: Sequence[dict[str, Any]]) -> list[dict[str, float]]:
    """One row per step (`step` first, then its align/ metrics) from a Trainer's log history, the last entry of a
    step kept."""
    rows: dict[int, dict[str, float]] = {}
    for entry in log_history:
        if _is_step_entry(entry):
            rows[int(entry["step"])] = {"step": int(entry["step"]), **align_metrics(entry)}
    return [rows[s] for s in sorted(rows)]


def log_callback(log_fn: LogFn | None):
    """A TrainerCallback: each step's log as `align_metrics` to `log_fn`; a resumed run first replays the steps its
    checkpoint holds, so its curves start at step 1 (as PPO's do)."""
    from transformers.trainer_callback import TrainerCallback

    class AlignLogCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if log_fn and state.global_step > 0:
                for row in history_of(state.log_history):
                    step = row.pop("step")
                    log_fn(row, step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if log_fn and logs and "train_runtime" not in logs:
                log_fn(align_metrics(logs), state.global_step)

    return AlignLogCallback()


# ---- training ------------------------------------------------------------------------------------


@contextlib.contextmanager
def neutral_generation_config(model, eos_ids: Sequence[int]) -> Iterator[None]:
    """While inside: the model's generation_config says only which tokens end a completion and which pads, so its
    own defaults (repetition penalties, typical-p, ...) never reach trl's sampling, as PPO ignores them
    (rlhflow.models.generation.generate). The model's own config is put back afterwards, so the saved policy keeps
    it."""

    saved = model.generation_config
    model.generation_config = GenerationConfig(
        eos_token_id=list(eos_ids),
        pad_token_id=saved.pad_token_id if saved is not None else None,
        bos_token_id=saved.bos_token_id if saved is not None else None,
    )
    try:
        yield
    finally:
        model.generation_config = saved


def build_trainer(
    settings: AlignSettings,
    *,
    policy,
    tokenizer,
    train_rows: Sequence[dict],
    work_dir: str | Path,
    device: torch.device,
    score_fn: Callable | None = None,
    ref_model=None,
    log_fn: LogFn | None = None,
):
    """trl's trainer for `align.algorithm` on the policy (the SFT model, loaded), ready to train. GRPO and RLOO
    need `score_fn` (PPO's reward source); DPO's reference is `ref_model` (a frozen copy of the SFT model)."""
    algorithm = settings.align.algorithm
    args = trainer_args(settings, device, work_dir)
    callbacks = [log_callback(log_fn)]
    if algorithm in SAMPLING_ALGORITHMS:
        from trl import GRPOTrainer, RLOOTrainer

        if score_fn is None:
            raise ValueError(f"align.algorithm={algorithm} needs a reward source")
        reward = ProxyReward(
            score_fn,
            eos_ids=stop_token_ids(tokenizer, policy, settings.ppo.stop_strings),
            missing_eos_penalty=settings.ppo.missing_eos_penalty,
            record_dir=Path(work_dir) / SCORED_DIR,
        )
        base = GRPOTrainer if algorithm == "grpo" else RLOOTrainer
        trainer_class = _with_ppo_prompts(base, settings.ppo.max_prompt_length)
        return trainer_class(
            model=policy,
            reward_funcs=[reward],
            args=args,
            train_dataset=prompt_dataset(train_rows),
            processing_class=tokenizer,
            callbacks=callbacks,
        )
    from trl import DPOTrainer

    return DPOTrainer(
        model=policy,
        ref_model=ref_model,
        args=args,
        data_collator=truncating_collator(
            tokenizer.pad_token_id, settings.ppo.max_prompt_length, settings.align.dpo.max_response_length
        ),
        train_dataset=preference_dataset(train_rows, tokenizer),
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def train_policy(
    settings: AlignSettings,
    *,
    policy,
    tokenizer,
    train_rows: Sequence[dict],
    work_dir: str | Path,
    device: torch.device,
    score_fn: Callable | None = None,
    ref_model=None,
    log_fn: LogFn | None = None,
):
    """Train the policy with `align.algorithm` (resuming from the last complete Trainer checkpoint in `work_dir`,
    which the caller keeps only for the same inputs) and return (trained policy, per-step history)."""
    algorithm = settings.align.algorithm
    with neutral_generation_config(policy, stop_token_ids(tokenizer, policy, settings.ppo.stop_strings)):
        trainer = build_trainer(
            settings,
            policy=policy,
            tokenizer=tokenizer,
            train_rows=train_rows,
            work_dir=work_dir,
            device=device,
            score_fn=score_fn,
            ref_model=ref_model,
            log_fn=log_fn,
        )
        resumed_fn = (lambda m, step: log_fn({PREFIX + k: v for k, v in m.items()}, step)) if log_fn else None
        train_resuming(trainer, work_dir, what=algorithm, log_fn=resumed_fn)
    return trainer.model, history_of(trainer.state.log_history)


def completions_table(work_dir: str | Path, algorithm: str):
    """What the run sampled, one row per completion, for an MLflow table: trl's own completion logs for GRPO
    (output_dir/completions/*.parquet: prompt, completion, reward, advantage, score, ended), what ProxyReward scored
    for RLOO (prompt, completion, score, reward, ended);
    None for DPO (it samples nothing) or when nothing was written."""

    work_dir = Path(work_dir)
    files = sorted((work_dir / ("completions" if algorithm == "grpo" else SCORED_DIR)).glob("*.parquet"))
    if algorithm not in SAMPLING_ALGORITHMS or not files:
        return None
    table = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    table = table.rename(columns={REWARD_NAME: "reward"})
    # trl's prompts and completions are chat messages: as text
    table["prompt"] = [v if isinstance(v, str) else render_messages(list(v)) for v in table["prompt"]]
    table["completion"] = [v if isinstance(v, str) else _completion_text(list(v)) for v in table["completion"]]
    return table
