"""Precision and memory knobs of the PPO engine on the tiny Llama (CPU): what `auto` picks, bf16 autocast with fp32
master weights and fp32 losses, the first PPO ratio, gradient accumulation over micro-batches and gradient
checkpointing (same gradients as the plain minibatch)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from rlhflow.models import loading
from rlhflow.models.loading import (
    autocast,
    bf16_is_native,
    linear_weights_to,
    output_layer_in_fp32,
    resolve_precision,
    trainer_bf16,
)
from rlhflow.models.policy import PolicyAndValue
from rlhflow.ppo import core
from tests.fixtures import tiny_llama
from tests.test_ppo_trainer import make_trainer

pytestmark = pytest.mark.usefixtures("one_thread")

# ---- the precision choice ------------------------------------------------------------------------


def _proc_cpu_flags() -> set[str]:
    for line in open("/proc/cpuinfo").read().splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def test_this_cpu_is_read_from_its_flags():
    native = bool(_proc_cpu_flags() & {"avx512_bf16", "amx_bf16"})
    assert bf16_is_native("cpu") == native
    assert resolve_precision("auto", "cpu") == (torch.bfloat16 if native else torch.float32)


@pytest.mark.parametrize(
    "flags,auto",
    [
        ({"avx512f", "avx512_bf16"}, torch.bfloat16),
        ({"amx_bf16", "amx_tile"}, torch.bfloat16),
        ({"avx2"}, torch.float32),
    ],
)
def test_auto_is_bf16_only_on_a_cpu_that_runs_it_natively(monkeypatch, flags, auto):
    monkeypatch.setattr(loading, "cpu_flags", lambda: frozenset(flags))
    assert resolve_precision("auto", torch.device("cpu")) == auto
    assert resolve_precision("fp32", "cpu") == torch.float32
    # under auto the reward models' Trainer follows the CPU; sft and align keep fp32 on every CPU (TRAINER_BF16_ON_CPU)
    assert resolve_precision("auto", "cpu", bf16_on_cpu=False) == torch.float32
    assert trainer_bf16("auto", "cpu", "reward_model") is (auto == torch.bfloat16)
    for trainer in ("sft", "align"):
        assert trainer_bf16("auto", "cpu", trainer) is False and trainer_bf16("bf16", "cpu", trainer) is True
        assert trainer_bf16("fp32", "cpu", trainer) is False


def test_forced_bf16_without_native_support_runs_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(loading, "cpu_flags", lambda: frozenset({"avx2"}))
    loading._warn_emulated_bf16.cache_clear()
    with caplog.at_level(logging.WARNING, logger="rlhflow.models.loading"):
        assert resolve_precision("bf16", "cpu") == torch.bfloat16
        assert resolve_precision("bf16", "cpu") == torch.bfloat16  # warned once
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "no native bf16" in warnings[0] and "\n" not in warnings[0]
    loading._warn_emulated_bf16.cache_clear()
    with pytest.raises(ValueError, match="unknown precision 'fp16'"):
        resolve_precision("fp16", "cpu")


def test_a_frozen_copy_with_bf16_linear_weights_computes_what_autocast_computes(tok):
    """The reference's storage: linear weights in bf16 (the tied head gets its own copy), embeddings and norms fp32;
    under autocast it gives bit for bit the logits of the fp32 model under autocast."""
    model = tiny_llama(tok, hidden=64)
    frozen = linear_weights_to(copy.deepcopy(model), torch.bfloat16)
    assert (
        frozen.lm_head.weight.dtype == torch.bfloat16
        and frozen.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    )
    assert frozen.model.embed_tokens.weight.dtype == torch.float32 and frozen.model.norm.weight.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the original keeps its tie
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad(), autocast("cpu", torch.bfloat16):
        assert torch.equal(frozen(ids).logits, model(ids).logits)
    with torch.no_grad():
        fp32 = model(ids).logits
    with torch.no_grad(), autocast("cpu", torch.bfloat16):
        bf16 = model(ids).logits
    assert not torch.equal(bf16.float(), fp32) and torch.allclose(bf16.float(), fp32, atol=0.05)


def test_an_fp32_output_layer_computes_the_logits_in_fp32_under_autocast(tok):
    """output_layer_in_fp32: the rest of the model in bf16, the logits the fp32 product of its last hidden state and
    the head's weight; the parameters, the tie to the embeddings and the state dict as they were; a copy, and a
    frozen copy with bf16 linear weights, keep the fp32 head (still tied)."""
    model = tiny_llama(tok, hidden=64)
    keys = list(model.state_dict())
    fp32_head = output_layer_in_fp32(copy.deepcopy(model))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad(), autocast("cpu", torch.bfloat16):
        hidden = fp32_head.model(ids).last_hidden_state
        logits = fp32_head(ids).logits
        rounded = model(ids).logits
    assert logits.dtype == torch.float32 and rounded.dtype == torch.bfloat16
    assert torch.equal(logits, hidden.float() @ fp32_head.lm_head.weight.T)
    assert torch.allclose(logits, rounded.float(), atol=0.05) and not torch.equal(logits, rounded.float())
    assert list(fp32_head.state_dict()) == keys
    assert fp32_head.lm_head.weight is fp32_head.model.embed_tokens.weight
    for other in (copy.deepcopy(fp32_head), linear_weights_to(copy.deepcopy(fp32_head), torch.bfloat16)):
        assert other.lm_head.weight.dtype == torch.float32 and other.lm_head.weight is other.model.embed_tokens.weight
        with torch.no_grad(), autocast("cpu", torch.bfloat16):
            assert torch.equal(other(ids).logits, logits)


def test_bf16_forward_passes_autocast_but_logprobs_and_values_are_fp32(tok):
    model = tiny_llama(tok, hidden=64)
    qr = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11], [0, 0, 1, 5, 9, 8, 7, 6]])
    am = (qr != 0).long()
    matmul_dtypes = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: matmul_dtypes.append(o.dtype))
    fp32 = PolicyAndValue(copy.deepcopy(model), "shared")(qr, am, 4, 0.7, return_entropy=True)
    for value_model in ("shared", "separate"):
        pv = PolicyAndValue(model, value_model, compute_dtype=torch.bfloat16)
        if value_model == "separate":
            torch.nn.init.normal_(pv.critic.head.summary.weight, std=0.1)
        logprobs, values, entropy = pv(qr, am, 4, 0.7, return_entropy=True)
        assert logprobs.dtype == values.dtype == entropy.dtype == torch.float32
        assert matmul_dtypes[-1] == torch.bfloat16  # the policy's matmuls ran in bf16
        assert torch.allclose(logprobs, fp32[0], atol=0.05) and not torch.equal(logprobs, fp32[0])
        assert all(p.dtype == torch.float32 for p in pv.parameters())  # fp32 master weights


# ---- PPO in bf16 -----------------------------------------------------------------------------------

FIRST_RATIO_SETTINGS = {
    "fp32": dict(precision="fp32"),  # auto: old log-probs from the sampling pass's logits
    "fp32-forward": dict(precision="fp32", rollout_logprobs="forward"),
    "bf16": dict(precision="bf16"),
    "bf16-separate": dict(precision="bf16", value_model="separate"),
    "bf16-micro": dict(precision="bf16", micro_batch_size=2),
    "bf16-checkpointing": dict(precision="bf16", gradient_checkpointing=True),
    "bf16-lora": dict(precision="bf16", lora={"enabled": True, "r": 4, "alpha": 8}),
    "bf16-fp32-head": dict(precision="bf16", fp32_lm_head=True),
    "bf16-fp32-head-lora": dict(precision="bf16", fp32_lm_head=True, lora={"enabled": True, "r": 4, "alpha": 8}),
}


@pytest.mark.parametrize("setting", list(FIRST_RATIO_SETTINGS))
def test_the_first_ratio_is_one(tok, tmp_path, monkeypatch, setting):
    """At the first minibatch of the first update pi = pi_old: the rollout computed the old log-probs with the same
    forward pass, on the same rows in the same order, so the ratio is 1 to within rounding. The forward paths are
    the identical computation (|ratio - 1| = 0 measured, bf16 included); fp32 from the sampling pass's logits
    (KV-cache decoding) adds in another order, ~1e-6. Without the same rows per pass, bf16's 8-bit mantissa alone
    would allow |log ratio| ~ 2^-8 * |logit| (about 1e-2 for logits near 5)."""
    ratios = []
    original = core.policy_loss

    def recording(logprobs, old_logprobs, advantages, mask, *args):
        ratios.append(((logprobs - old_logprobs).exp() - 1).abs().mul(mask).max().item())
        return original(logprobs, old_logprobs, advantages, mask, *args)

    monkeypatch.setattr(core, "policy_loss", recording)
    trainer = make_trainer(tok, tmp_path, steps=1, policy=tiny_llama(tok, hidden=64), **FIRST_RATIO_SETTINGS[setting])
    stats = trainer.update()
    assert ratios[0] < 1e-5, ratios[0]
    if trainer.dtype == torch.bfloat16:
        assert ratios[0] == 0.0
        assert stats["ppo/kl"] == 0.0  # the bf16-held reference computes exactly what the start policy does
    assert max(ratios[1:]) > 1e-4  # later minibatches see the updated policy


def test_bf16_keeps_fp32_master_weights_and_optimizer_state_and_a_bf16_reference(tok, tmp_path):
    trainer = make_trainer(tok, tmp_path, steps=1, precision="bf16", value_model="separate")
    trainer.update()
    assert trainer.dtype == torch.bfloat16 and not trainer.logprobs_from_generation  # auto: the forward path
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    states = [s for s in trainer.optimizer.state.values() if s]
    assert states and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in states)
    ref = trainer.ref_policy
    assert ref.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert ref.model.embed_tokens.weight.dtype == torch.float32
    assert all(not p.requires_grad for p in ref.parameters())


def test_bf16_rollouts_sample_from_a_bf16_copy_that_follows_the_master_weights(tok, tmp_path):
    """The sampling copy holds the linear weights in bf16 and is refreshed before each rollout: its samples are the
    tokens the fp32 master weights give under autocast, before and after an update (the head is tied to the
    embeddings in tiny_llama: the copy's own head follows them)."""
    trainer = make_trainer(tok, tmp_path, steps=2, precision="bf16", policy=tiny_llama(tok, hidden=64))
    copy_q = trainer.sampler.model.layers[0].self_attn.q_proj.weight
    assert copy_q.dtype == torch.bfloat16 and not copy_q.requires_grad
    messages = [trainer.prompts[i] for i in range(4)]

    def same_tokens_as_the_policy(stream: int) -> None:
        from_copy = trainer._sample(messages, stream=stream).query_response
        sampler, trainer.sampler = trainer.sampler, None  # the policy itself, under autocast
        try:
            from_policy = trainer._sample(messages, stream=stream).query_response
        finally:
            trainer.sampler = sampler
        assert torch.equal(from_copy, from_policy)

    same_tokens_as_the_policy(stream=7)
    start = trainer.policy.model.layers[0].self_attn.q_proj.weight.detach().clone()
    trainer.update()
    same_tokens_as_the_policy(stream=8)
    master_q = trainer.policy.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(master_q, start) and torch.equal(copy_q, master_q.to(torch.bfloat16))
    assert torch.equal(trainer.sampler.lm_head.weight, trainer.policy.lm_head.weight.to(torch.bfloat16))
    assert make_trainer(tok, tmp_path / "lora", precision="bf16", lora={"enabled": True, "r": 4}).sampler is None


def test_fp32_lm_head_computes_the_logits_of_policy_sampling_copy_and_reference_in_fp32(tok, tmp_path):
    trainer = make_trainer(
        tok, tmp_path, steps=1, precision="bf16", fp32_lm_head=True, policy=tiny_llama(tok, hidden=64)
    )
    trainer.update()
    for model in (trainer.policy, trainer.sampler, trainer.ref_policy):
        head = model.lm_head
        assert head.weight.dtype == torch.float32 and getattr(head, loading.FP32_OUTPUT)
        assert head.weight is model.model.embed_tokens.weight
    trainer._sample([trainer.prompts[0]], stream=3)  # refreshes the copy from the updated master weights
    assert torch.equal(trainer.sampler.lm_head.weight, trainer.policy.lm_head.weight)
    assert trainer.sampler.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    plain = make_trainer(tok, tmp_path / "plain", precision="bf16", policy=tiny_llama(tok, hidden=64))
    assert not getattr(plain.policy.lm_head, loading.FP32_OUTPUT, False)
    fp32 = make_trainer(tok, tmp_path / "fp32", precision="fp32", fp32_lm_head=True, policy=tiny_llama(tok, hidden=64))
    assert not getattr(fp32.policy.lm_head, loading.FP32_OUTPUT, False)  # bf16 only


def test_bf16_refuses_old_logprobs_from_generation(tok, tmp_path):
    with pytest.raises(ValueError, match="ppo.rollout_logprobs=generation with ppo.precision=bf16"):
        make_trainer(tok, tmp_path, precision="bf16", rollout_logprobs="generation")


def test_fp32_takes_old_logprobs_from_sampling_only_where_fp32_matmuls_are_exact(tok, tmp_path, monkeypatch):
    """auto: the sampling pass's logits for an fp32 policy with exact fp32 matmuls; a forward pass of its own with
    TF32 matmuls (a CUDA GPU after enable_tf32), where decoding and a full pass differ by more than rounding."""
    from rlhflow.ppo import trainer as trainer_module

    assert make_trainer(tok, tmp_path / "exact", precision="fp32").logprobs_from_generation
    monkeypatch.setattr(trainer_module, "fp32_matmuls_exact", lambda device: False)
    assert not make_trainer(tok, tmp_path / "tf32", precision="fp32").logprobs_from_generation
    assert make_trainer(
        tok, tmp_path / "asked", precision="fp32", rollout_logprobs="generation"
    ).logprobs_from_generation


def test_reward_model_scores_in_bf16_close_to_fp32(tok, tiny_model_dir):
    from transformers import AutoModelForSequenceClassification

    from rlhflow.ppo.reward_and_critic import in_precision
    from rlhflow.training.reward_model import RewardModel

    torch.manual_seed(0)
    rm = RewardModel(
        AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1), tok, max_length=64
    )
    prompts = [[{"role": "user", "content": "hello world"}], [{"role": "user", "content": "explain water"}]]
    responses = ["yes thanks", "Water boils at one hundred degrees."]
    fp32 = rm.score(prompts, responses)
    score_fn = rm.score
    assert (
        in_precision(score_fn, rm, torch.float32) is score_fn
        and in_precision(score_fn, None, torch.bfloat16) is score_fn
    )
    score = in_precision(score_fn, rm, torch.bfloat16)
    assert rm.model.score.weight.dtype == torch.bfloat16
    bf16 = score(prompts, responses)
    assert bf16.dtype == torch.float32 and torch.allclose(bf16, fp32, atol=0.05)


# ---- micro-batches and gradient checkpointing --------------------------------------------------------


def _grads(trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad and p.grad is not None}


def _assert_same_grads(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    scale = max(g.abs().max().item() for g in a.values())
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=1e-4, atol=1e-6 * scale), name


def _ragged(batch: dict, pad_id: int) -> dict:
    """The rollout with responses cut to different lengths (as EOS cuts them), right-padded as rollouts are: the
    micro-batches then hold different numbers of tokens."""
    ctx, mask = batch["context_length"], batch["mask"]
    lengths = torch.arange(mask.shape[0]) % mask.shape[1] + 1
    keep = (torch.arange(mask.shape[1])[None, :] < lengths[:, None]).float() * mask
    batch = dict(batch, mask=keep)
    batch["attention_mask"] = torch.cat([batch["attention_mask"][:, :ctx], keep.long()], 1)
    batch["query_response"] = batch["query_response"].clone()
    batch["query_response"][:, ctx:][keep == 0] = pad_id
    for key in ("logprobs", "values", "advantages", "returns"):
        batch[key] = batch[key] * keep
    return batch


def _minibatch_gradients(trainer, batch, rows, *, train_mode=False):
    trainer.model.train(train_mode)  # as _optimize does for gradient checkpointing
    stats = trainer._minibatch_gradients(batch, rows, update=1)
    trainer.model.eval()
    return stats, _grads(trainer)


GRADIENT_SETTINGS = {
    "shared": dict(entropy_coef=0.01),
    "separate": dict(value_model="separate"),
    "lora": dict(lora={"enabled": True, "r": 4, "alpha": 8}),
    # each micro-batch's mean over its answers, weighted by its share of the minibatch's answers
    "sequence_mean": dict(loss_aggregation="sequence_mean", entropy_coef=0.01),
}


@pytest.mark.parametrize("setting", list(GRADIENT_SETTINGS))
def test_micro_batches_and_checkpointing_give_the_minibatch_gradient(tok, tmp_path, setting):
    """A minibatch of 8 responses in micro-batches of 2 and 1 (each token-mean loss weighted by its share of the
    minibatch's tokens) and with gradient checkpointing: the gradient of the whole minibatch at once (fp32)."""
    extra = dict(GRADIENT_SETTINGS[setting], precision="fp32", mini_batch_size=8, ppo_epochs=1)
    policy = tiny_llama(tok, hidden=64)
    plain = make_trainer(tok, tmp_path / "plain", policy=copy.deepcopy(policy), **extra)
    if setting == "separate":  # a zero head sends no gradient into the critic's backbone
        torch.nn.init.normal_(plain.model.critic.head.summary.weight, std=0.1)
    batch = _ragged(plain._rollout(1)[0], tok.pad_token_id)
    rows = batch["order"][:8]
    assert batch["advantages"].abs().max() > 0 and batch["mask"][rows].sum(1).unique().numel() > 4
    stats, expected = _minibatch_gradients(plain, batch, rows)
    trained = {n for n, g in expected.items() if g.abs().max() > 0}
    assert any("value_head" in n or "critic.head" in n for n in trained)
    if setting == "separate":
        assert any("critic.backbone" in n for n in trained)
    if setting == "lora":
        assert any("lora_" in n for n in trained)

    for knobs in (dict(micro_batch_size=2), dict(micro_batch_size=1), dict(gradient_checkpointing=True)):
        other = make_trainer(tok, tmp_path / "other", policy=copy.deepcopy(policy), **extra, **knobs)
        other.model.load_state_dict(plain.model.state_dict())
        other_stats, got = _minibatch_gradients(other, batch, rows, train_mode=other.cfg.gradient_checkpointing)
        _assert_same_grads(expected, got)
        assert other_stats == pytest.approx(stats, rel=1e-4, abs=1e-7)


def test_gradient_checkpointing_recomputes_the_layers_in_the_backward_pass(tok, tmp_path):
    """With checkpointing each training forward pass of a layer runs once more in backward; nothing else changes."""
    calls = {}
    for checkpointing in (False, True):
        trainer = make_trainer(
            tok,
            tmp_path / str(checkpointing),
            steps=1,
            precision="fp32",
            micro_batch_size=4,
            gradient_checkpointing=checkpointing,
        )
        n = []
        trainer.policy.model.layers[0].self_attn.register_forward_hook(lambda *args, n=n: n.append(1))
        stats = trainer.update()
        calls[checkpointing] = (len(n), stats)
    training_passes = (16 // 4) * 2  # batch 16 in micro-batches of 4, 2 epochs
    assert calls[True][0] - calls[False][0] == training_passes
    assert calls[True][1]["ppo/policy_loss"] == pytest.approx(calls[False][1]["ppo/policy_loss"], rel=1e-4, abs=1e-6)
    assert not trainer.model.training  # back in eval mode after the update


def test_micro_batch_size_must_divide_the_minibatch(tok, tmp_path):
    with pytest.raises(ValueError, match=r"ppo.micro_batch_size \(3\) must divide ppo.mini_batch_size \(8\)"):
        make_trainer(tok, tmp_path, mini_batch_size=8, micro_batch_size=3)
