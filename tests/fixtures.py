"""Tiny, real models for tests and smoke runs: a small byte-level BPE tokenizer with a ChatML
template (like SmolLM2's) and a randomly initialised Llama of a few hundred thousand parameters.
Everything is built locally in about a second; nothing is downloaded."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rlhflow.models.loading import prepare_tokenizer, save_plain

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Please explain how photosynthesis works in simple terms.",
    "Here are three clear steps: first, second, and finally third.",
    "Thank you for asking! I am happy to help with your question.",
    "user assistant system You are a helpful assistant.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "A good answer is relevant, helpful, polite and well structured.",
    "yes no maybe hello world great thanks sorry cannot answer that",
    "0 1 2 3 4 5 6 7 8 9 ! ? . , : ; - ( ) ' \" \n",
]


def tiny_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    return prepare_tokenizer(fast)


def tiny_llama(
    tokenizer: PreTrainedTokenizerFast, *, hidden: int = 32, layers: int = 2, seed: int = 0
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def varied_tiny_llama(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """Weights large enough that greedy answers differ from row to row (a fresh tiny model repeats one token)."""
    model = tiny_llama(tokenizer, hidden=48)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() > 1:
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.3)
    return model


def write_tiny_model(out_dir: str | Path, *, hidden: int = 32, layers: int = 2, seed: int = 0) -> Path:
    """A tiny model dir usable anywhere a model spec is expected (`sft.model`, `reward_model.backbone`)."""
    tok = tiny_tokenizer()
    save_plain(tiny_llama(tok, hidden=hidden, layers=layers, seed=seed), tok, out_dir)
    return Path(out_dir)


def prompt_length_reward(prompts, responses) -> list[float]:
    """A deterministic test reward that differs across prompts even when a tiny model's responses are alike
    (greedy tiny models often repeat special tokens that decode to nothing): prompt plus response characters.
    Once the file named by $RLHF_TEST_HANG_WHEN exists it never returns: a run to kill at a known update."""
    hang_when = os.environ.get("RLHF_TEST_HANG_WHEN")
    if hang_when and Path(hang_when).exists():
        time.sleep(3600)
    return [(len(p[-1]["content"]) + len(r)) / 10 for p, r in zip(prompts, responses)]


def relocate_mlflow_store(db: Path, old_root: Path, new_root: Path) -> None:
    """Point a copied sqlite MLflow store at its new place: every stored path under `old_root` (artifact locations
    of experiments, runs, logged models and model versions; dataset sources; source-file tags) now names the same
    file under `new_root`."""
    old, new = str(old_root), str(new_root)
    with contextlib.closing(sqlite3.connect(db)) as con, con:
        tables = [row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for table in tables:
            for _, column, kind, *_ in con.execute(f"PRAGMA table_info('{table}')").fetchall():
                if kind.upper().startswith(("VARCHAR", "TEXT")):
                    con.execute(
                        f'UPDATE "{table}" SET "{column}" = replace("{column}", ?, ?) WHERE instr("{column}", ?) > 0',
                        (old, new, old),
                    )
