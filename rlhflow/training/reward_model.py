"""Reward model: Bradley-Terry pairwise training with trl's RewardTrainer, and scoring of decoded text.

Loss (Bradley-Terry): L = -log sigmoid(r(x, y_chosen) - r(x, y_rejected)), averaged over pairs,
plus TRL's optional centring term c * mean((r_c + r_r)^2) that keeps scores near zero.

The reward model scores *text*: prompt and response are encoded with the reward model's own tokenizer
(`encode_pair`), in training and in scoring alike. So the policy and the reward model may use different
tokenizers, and the same function defines what the reward model sees everywhere. After training, scores
are normalised with the mean and std over the training responses, so that a KL coefficient keeps its
meaning whatever the scale of the head.
"""

from __future__ import annotations

# trl, datasets, transformers' Trainer and its callbacks are imported by the functions that train (train_reward_model,
# length_heads_trainer) and pair_dataset only: scoring with a trained reward model (PPO, evaluation, serving) never
# loads them.
import functools
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedTokenizerBase

from rlhflow.data.sources import resolve_model
from rlhflow.models.loading import disable_dropout, pick_device, trainer_bf16
from rlhflow.training import distributed, length_heads
from rlhflow.training.hf_trainer import checkpoint_args, log_callback, train_resuming

NORM_FILE = "reward_normalization.json"
NORM_SAMPLE_PAIRS = 256  # training pairs whose scores set the normalisation
Messages = list[dict[str, str]]


def prepare_reward_tokenizer(tok: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    # Right padding: encoders pool the first ([CLS]) token, decoders read the last non-pad token; both need
    # real tokens where they look. Left truncation keeps the end of long prompts next to the response.
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    tok.padding_side = "right"
    tok.truncation_side = "left"
    return tok


def encode_pair(tok: PreTrainedTokenizerBase, prompt_messages: Messages, response: str, max_length: int) -> list[int]:
    """Token ids of (prompt, response) as the reward model sees them, at most `max_length` long.

    A pair too long loses the start of the prompt first (the end of the prompt stays next to the response); only a
    response too long on its own loses its end. The tokens the tokenizer or the chat template adds around the texts
    ([CLS]/[SEP], the end of the assistant turn) are always kept, so the score is read where it always is."""
    if tok.chat_template:
        ids, parts = _chat_pair(tok, prompt_messages, response)
    else:
        prompt = "\n".join(
            m["content"] if m["role"] == "user" else f"{m['role']}: {m['content']}" for m in prompt_messages
        )
        # the encoder's pair encoding: [CLS] prompt [SEP] response [SEP]; sequence_ids says which text a token is of
        encoded = tok(prompt, response, verbose=False)
        ids, parts = list(encoded["input_ids"]), encoded.sequence_ids()
    return _fit_pair(ids, parts, max_length)


def _chat_pair(tok: PreTrainedTokenizerBase, prompt_messages: Messages, response: str):
    """The chat template's rendering of the prompt and the assistant's response, as (ids, parts): part 0 for the
    prompt (the generation prompt included), 1 for the response, None for what the template adds after it."""
    full = tok.apply_chat_template(prompt_messages + [{"role": "assistant", "content": response}], tokenize=False)
    head = tok.apply_chat_template(prompt_messages, add_generation_prompt=True, tokenize=False)
    start = len(os.path.commonprefix([head, full]))
    at = full.find(response, start)
    if at < 0:  # a template that rewrites the response: all that follows the prompt counts as the response
        at, end = start, len(full)
    else:
        end = at + len(response)
    ids, parts = [], []
    for text, part in ((full[:at], 0), (full[at:end], 1), (full[end:], None)):
        piece = tok(text, add_special_tokens=False)["input_ids"] if text else []
        ids += piece
        parts += [part] * len(piece)
    return ids, parts


def _fit_pair(ids: list[int], parts: list[int | None], max_length: int) -> list[int]:
    """Cut (ids, parts) to `max_length`: every added token (part None) stays, then the start of the response
    (part 1), then the end of the prompt (part 0)."""
    if len(ids) <= max_length:
        return ids
    room = max(max_length - parts.count(None), 0)
    keep_response = min(parts.count(1), room)
    drop_prompt = parts.count(0) - (room - keep_response)  # from the prompt's start
    kept, seen = [], {0: 0, 1: 0}
    for token, part in zip(ids, parts):
        if part is not None:
            seen[part] += 1
            if (part == 0 and seen[0] <= drop_prompt) or (part == 1 and seen[1] > keep_response):
                continue
        kept.append(token)
    return kept


class MaskedMeanPooler(torch.nn.Module):
    """Mean of the final hidden states over the real (unpadded) tokens, in place of BERT's [CLS] pooler.
    Sentence encoders such as all-MiniLM-L6-v2 are trained to be read this way; their [CLS] vector is not."""

    def __init__(self):
        super().__init__()
        self.attention_mask: torch.Tensor | None = None  # set by a hook on the encoder before each forward

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        mask = (
            self.attention_mask
            if self.attention_mask is not None
            else torch.ones(hidden_states.shape[:2], device=hidden_states.device)
        )
        mask = mask.unsqueeze(-1).to(hidden_states.dtype)
        return (hidden_states * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)


def apply_pooling(model, pooling: str):
    """Read the score from the encoder's masked mean (`mean`) or the architecture's own choice (`model`: BERT's
    [CLS] pooler, a decoder's last real token). Recorded in the model's config, so `RewardModel.load` restores it."""
    if pooling == "model":
        return model
    encoder = getattr(model, model.base_model_prefix, None)
    if getattr(encoder, "pooler", None) is None:
        raise ValueError(
            f"reward_model.pooling=mean needs an encoder with a pooler (BERT-like); "
            f"{type(model).__name__} has none: use pooling=model"
        )
    pooler = MaskedMeanPooler()
    encoder.pooler = pooler

    def remember_mask(module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        pooler.attention_mask = mask if mask is not None else torch.ones_like(input_ids)

    encoder.register_forward_pre_hook(remember_mask, with_kwargs=True)
    model.config.reward_pooling = pooling
    return model


def _classifier_from_pretrained(location, expected: Callable[[object, str], bool], **kwargs):
    """AutoModelForSequenceClassification.from_pretrained, whose load report (a warning listing missing, unexpected
    and mismatched weights) is logged only when it lists a weight not `expected(model, key)`: one this code creates
    or drops on purpose says nothing about the checkpoint."""

    report_log, held, info = logging.getLogger("transformers.modeling_utils"), [], None

    def hold(record: logging.LogRecord) -> bool:
        if record.thread == threading.get_ident() and "LOAD REPORT" in record.getMessage():
            held.append(record)
            return False
        return True

    report_log.addFilter(hold)
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(location, output_loading_info=True, **kwargs)
    finally:
        report_log.removeFilter(hold)
        keys = [] if info is None else [*info["missing_keys"], *info["unexpected_keys"]]
        if info is None or info["mismatched_keys"] or not all(expected(model, key) for key in keys):
            for record in held:
                report_log.handle(record)
    return model


def load_backbone(spec: str, *, trust_remote_code: bool = False, pooling: str = "model", length_head: bool = False):
    """A sequence-classification model with one output (the score), or with `length_head` two (the quality and the
    length head, rlhflow.training.length_heads), and its tokenizer."""
    labels = ["quality", "length"] if length_head else ["LABEL_0"]
    src = resolve_model(spec)
    tok = prepare_reward_tokenizer(
        AutoTokenizer.from_pretrained(src.location, trust_remote_code=trust_remote_code, **src.kwargs())
    )
    model = _classifier_from_pretrained(
        src.location,
        # the new score head is missing from the checkpoint, the checkpoint's own head (an LM head) unused
        lambda model, key: not key.startswith(f"{model.base_model_prefix}."),
        # the labels name the outputs (one: as num_labels=1 names it); num_labels warns when the backbone's config
        # has the default two
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
        trust_remote_code=trust_remote_code,
        **src.weights_kwargs(),
    )
    model.config.pad_token_id = tok.pad_token_id
    return disable_dropout(apply_pooling(model, pooling)), tok


class RewardModel:
    """Scores (prompt, response) pairs; `score` returns normalised rewards as a float tensor [B]."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_length: int,
        mean: float = 0.0,
        std: float = 1.0,
        batch_size: int = 32,
        device: str | torch.device = "cpu",
    ):
        self.model = model.to(device).eval()
        self.tokenizer = prepare_reward_tokenizer(tokenizer)
        self.max_length = max_length
        self.mean, self.std = mean, std
        self.batch_size = batch_size
        self.device = torch.device(device)

    @classmethod
    def load(cls, model_dir: str | os.PathLike, *, batch_size: int = 32, device: str | torch.device = "cpu"):
        model_dir = Path(model_dir)
        norm = json.loads((model_dir / NORM_FILE).read_text())
        model = _classifier_from_pretrained(
            model_dir,
            # a model trained with pooling=mean was saved without the pooler that apply_pooling replaces
            lambda model, key: (
                getattr(model.config, "reward_pooling", "model") == "mean"
                and key.startswith(f"{model.base_model_prefix}.pooler.")
            ),
            use_safetensors=True,
        )
        model = apply_pooling(model, getattr(model.config, "reward_pooling", "model"))
        tok = AutoTokenizer.from_pretrained(model_dir)
        return cls(
            disable_dropout(model),
            tok,
            max_length=norm["max_length"],
            mean=norm["mean"],
            std=norm["std"],
            batch_size=batch_size,
            device=device,
        )

    @torch.no_grad()
    def raw_scores(self, prompt_messages: list[Messages], responses: list[str]) -> torch.Tensor:
        ids = [encode_pair(self.tokenizer, p, r, self.max_length) for p, r in zip(prompt_messages, responses)]
        # Batches of similar lengths pad little: scoring cost follows the real tokens, not the longest sequence.
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        scores = torch.zeros(len(ids))
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            batch = self.tokenizer.pad({"input_ids": [ids[i] for i in rows]}, return_tensors="pt")
            logits = self.model(**{k: v.to(self.device) for k, v in batch.items()}).logits
            scores[rows] = logits[:, 0].float().cpu()
        return scores

    def normalise(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw scores to rewards: minus the mean, over the std of the training responses' scores."""
        return (raw - self.mean) / self.std

    def score(self, prompt_messages: list[Messages], responses: list[str]) -> torch.Tensor:
        return self.normalise(self.raw_scores(prompt_messages, responses))

    __call__ = score


def response_tokens(tok: PreTrainedTokenizerBase, responses: list[str]) -> list[int]:
    """Each response's length in the reward tokenizer's tokens: the length the length head learns."""
    return [len(ids) for ids in tok(list(responses), add_special_tokens=False, verbose=False)["input_ids"]]


def pair_dataset(rows, tok: PreTrainedTokenizerBase, max_length: int, *, response_lengths: bool = False):
    """A tokenized `datasets.Dataset` (chosen_ids, rejected_ids) that RewardTrainer takes as processed, with each
    pair's `length` (its longer side) for batching pairs of similar length together; with `response_lengths`, each
    side's response length too (chosen_length, rejected_length: what the two-head loss reads)."""
    from datasets import Dataset

    chosen = [encode_pair(tok, r["prompt_messages"], r["chosen"], max_length) for r in rows]
    rejected = [encode_pair(tok, r["prompt_messages"], r["rejected"], max_length) for r in rows]
    columns = {
        "chosen_ids": chosen,
        "rejected_ids": rejected,
        "length": [max(len(c), len(r)) for c, r in zip(chosen, rejected)],
    }
    if response_lengths:
        columns["chosen_length"] = response_tokens(tok, [r["chosen"] for r in rows])
        columns["rejected_length"] = response_tokens(tok, [r["rejected"] for r in rows])
    return Dataset.from_dict(columns)


def length_heads_trainer(cfg, **kwargs):
    """A Trainer for the two heads (rlhflow.training.length_heads): trl's RewardTrainer fits one score and refuses a
    model with two, so this is transformers' Trainer with the two-head loss and a collator that hands it each
    response's length (trl's preference collator, which stacks the chosen responses over the rejected ones). `cfg` is
    the `reward_model` section. It logs what RewardTrainer logs (accuracy and margin of the preference q + l) and the
    loss's parts: the quality head's accuracy, both heads' correlation with length, their overlap."""
    from transformers.trainer import Trainer
    from trl.trainer.reward_trainer import DataCollatorForPreference

    class Collator(DataCollatorForPreference):
        def torch_call(self, examples):
            batch = super().torch_call(examples)
            lengths = [e["chosen_length"] for e in examples] + [e["rejected_length"] for e in examples]
            batch["response_lengths"] = torch.tensor(lengths, dtype=torch.float)
            return batch

    class LengthHeadsTrainer(Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.figures: dict[str, list[float]] = {}  # the loss's parts since the last log, averaged there

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            lengths = inputs.pop("response_lengths")
            outputs = model(**inputs, use_cache=False)
            loss, parts = length_heads.length_disentangled_loss(
                outputs.logits,
                lengths.to(outputs.logits.device),
                length_heads.score_head(self.accelerator.unwrap_model(model)).weight,
                length_weight=cfg.length_loss_weight,
                orthogonality_weight=cfg.orthogonality_weight,
                center_coefficient=cfg.center_rewards_coefficient,
            )
            chosen, rejected = outputs.logits.detach().sum(-1).chunk(2)
            parts |= {
                "accuracy": (chosen > rejected).float().mean().item(),
                "margin": (chosen - rejected).mean().item(),
            }
            for key, value in parts.items():
                self.figures.setdefault(key, []).append(value)
            return (loss, outputs) if return_outputs else loss

        def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
            logs.update({key: sum(values) / len(values) for key, values in self.figures.items() if values})
            self.figures = {}
            super().log(logs, start_time)

    tok = kwargs["processing_class"]
    return LengthHeadsTrainer(data_collator=Collator(pad_token_id=tok.pad_token_id), **kwargs)


def train_reward_model(
    cfg,
    train_rows: list[dict],
    *,
    backbone: str,
    out_dir: str | os.PathLike,
    work_dir: str | os.PathLike,
    seed: int = 0,
    log_fn: Callable[[dict, int], None] | None = None,
    trust_remote_code: bool = False,
    what: str = "reward model",
) -> RewardModel | None:
    """Train with trl's RewardTrainer on `train_rows` (dicts with prompt_messages/chosen/rejected) and save a
    plain model dir with its score normalisation to `out_dir`. `cfg` is the `reward_model` params section.

    Under `accelerate launch` with N processes the Trainer runs DDP: `cfg.batch_size` stays the global batch
    (N processes of batch_size / N pairs each), so the optimisation is the single-process one. Only the main
    process saves and scores; the others return None once training is done.

    With `cfg.checkpoint_every` > 0 the Trainer checkpoints into `work_dir` every that many steps (the last one
    kept), and training resumes from the last complete checkpoint found there: the caller keeps `work_dir` only
    for the same inputs (see `rlhflow.fsutil.prepare_checkpoint_dir`). `what` begins its lines in the run log
    ("reward model: step 20 of 52 ...")."""
    from trl import RewardTrainer

    torch.manual_seed(seed)  # the new score head's initialisation: the same in every run and every process
    model, tok = load_backbone(
        backbone, trust_remote_code=trust_remote_code, pooling=cfg.pooling, length_head=cfg.length_head
    )
    train = pair_dataset(train_rows, tok, cfg.max_length, response_lengths=cfg.length_head)
    args = reward_config(cfg, work_dir, seed)
    build = functools.partial(length_heads_trainer, cfg) if cfg.length_head else RewardTrainer
    trainer = build(model=model, args=args, train_dataset=train, processing_class=tok, callbacks=[log_callback(log_fn)])
    train_resuming(trainer, work_dir, what=what, log_fn=log_fn)
    if log_fn:  # the batch the Trainer actually used per optimisation step, over all processes
        log_fn(
            {
                "global_batch_size": float(
                    args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps
                ),
                "processes": float(args.world_size),
                "train_steps": float(trainer.state.global_step),
            },
            trainer.state.global_step,
        )
    if not distributed.is_main_process():
        return None
    # Score with the saved model, exactly as every later stage will load it.
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trainer.model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    write_normalization(out, mean=0.0, std=1.0, max_length=cfg.max_length)
    rm = RewardModel.load(out, batch_size=cfg.eval_batch_size, device=trainer.model.device)
    rm.mean, rm.std = normalization_of(rm, train_rows, seed)
    write_normalization(out, mean=rm.mean, std=rm.std, max_length=cfg.max_length)
    return rm


def reward_config(cfg, work_dir: str | os.PathLike, seed: int):
    """trl's RewardConfig from the `reward_model` section: `batch_size` global, split over the processes."""
    from trl import RewardConfig

    return RewardConfig(
        output_dir=str(work_dir),
        num_train_epochs=cfg.epochs,
        per_device_train_batch_size=distributed.shard_size(cfg.batch_size, "reward_model.batch_size"),
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        warmup_steps=cfg.warmup_ratio,
        lr_scheduler_type="linear",
        center_rewards_coefficient=cfg.center_rewards_coefficient,
        max_length=None,
        disable_dropout=True,
        logging_steps=5,
        eval_strategy="no",
        report_to="none",
        seed=seed,
        # batches of pairs of similar length (shuffled in groups) pad little: about 1.5x faster on real dialogues
        train_sampling_strategy="group_by_length",
        remove_unused_columns=False,
        **checkpoint_args(cfg.checkpoint_every),
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        disable_tqdm=False,
        bf16=trainer_bf16(cfg.precision, pick_device(), "reward_model"),  # auto: bf16 on native-bf16 CPUs too
        activation_checkpointing=cfg.gradient_checkpointing,  # transformers 5 name (gradient_checkpointing: deprecated)
    )


def normalization_of(rm: RewardModel, train_rows: list[dict], seed: int) -> tuple[float, float]:
    """The mean and std of the model's scores of training responses (chosen and rejected alike); a fixed sample of
    pairs estimates them well and keeps the cost of this pass bounded on large datasets."""
    sample = train_rows
    if len(train_rows) > NORM_SAMPLE_PAIRS:
        picked = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(seed))[:NORM_SAMPLE_PAIRS]
        sample = [train_rows[i] for i in sorted(picked.tolist())]
    prompts = [r["prompt_messages"] for r in sample]
    scores = torch.cat(
        [rm.raw_scores(prompts, [r["chosen"] for r in sample]), rm.raw_scores(prompts, [r["rejected"] for r in sample])]
    )
    return float(scores.mean()), float(scores.std().clamp_min(1e-6))


def write_normalization(model_dir: Path, *, mean: float, std: float, max_length: int) -> None:
    (model_dir / NORM_FILE).write_text(json.dumps({"mean": mean, "std": std, "max_length": max_length}, indent=2))
