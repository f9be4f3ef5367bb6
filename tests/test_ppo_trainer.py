"""The PPO engine end to end on the tiny Llama with programmatic rewards (CPU, fixed seeds)."""

import math
import warnings

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlhflow.config.params import PPOConfig
from rlhflow.models.policy import encode_prompts, sequence_logprobs
from rlhflow.ppo import core
from rlhflow.ppo.trainer import NonFiniteError, PPOTrainer
from tests.fixtures import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    [{"role": "user", "content": c}]
    for c in ("hello world", "explain water", "thanks", "say yes", "fox dog", "steps one two", "help me", "boils")
]

STAT_KEYS = {
    "ppo/score_mean",
    "ppo/score_std",
    "ppo/reward_total_mean",
    "ppo/kl",
    "ppo/kl_coef",
    "ppo/entropy",
    "ppo/clipfrac",
    "ppo/approxkl",
    "ppo/policy_loss",
    "ppo/value_loss",
    "ppo/value_clipfrac",
    "ppo/returns_mean",
    "ppo/advantages_mean",
    "ppo/response_length",
    "ppo/eos_fraction",
    "ppo/lr",
    "time/generation_s",
    "time/scoring_s",
    "time/training_s",
}


def vowel_fraction(prompts, texts):
    """The programmatic reward: the share of characters of the response that are vowels."""
    return torch.tensor([sum(ch in "aeiou" for ch in t) / max(len(t), 1) for t in texts])


def make_trainer(tok, tmp_path, score_fn=vowel_fraction, seed=0, policy=None, **overrides):
    params = dict(
        steps=4,
        batch_size=16,
        mini_batch_size=8,
        ppo_epochs=2,
        learning_rate=1e-2,
        max_new_tokens=8,
        temperature=1.0,
        kl_coef=0.01,
        missing_eos_penalty=None,
        checkpoint_every=0,
        checkpoint_dir=str(tmp_path / "ckpt"),
        out_dir=str(tmp_path / "policy"),
    )
    params.update(overrides)
    return PPOTrainer(
        PPOConfig(**params),
        policy=policy if policy is not None else tiny_llama(tok, seed=0),
        tokenizer=tok,
        score_fn=score_fn,
        prompts=PROMPTS,
        seed=seed,
    )


@pytest.mark.parametrize("value_model", ["shared", "separate"])
def test_reward_rises(tok, tmp_path, value_model):
    """Vowel share starts near 0.14 and passes 0.5 (mean of the last 3 updates) within 25 updates."""
    trainer = make_trainer(tok, tmp_path, steps=25, value_model=value_model)
    logged = []
    trainer.log_fn = lambda stats, step: logged.append(step)
    history = trainer.train()
    scores = [h["ppo/score_mean"] for h in history]
    assert len(history) == 25 and logged == list(range(1, 26))
    assert sum(scores[:3]) / 3 < 0.25
    assert sum(scores[-3:]) / 3 > 0.5, scores
    assert history[0]["ppo/kl"] == pytest.approx(0.0, abs=1e-5)  # the policy starts as the reference
    assert history[-1]["ppo/kl"] > 1.0
    assert set(history[-1]) >= STAT_KEYS
    assert all(math.isfinite(v) for h in history for v in h.values())


def test_missing_eos_penalty_in_the_rewards(tok, tmp_path):
    """Score 0 and no KL term: each response's total reward is -penalty when it did not end, else 0."""
    trainer = make_trainer(
        tok,
        tmp_path,
        score_fn=lambda p, t: torch.zeros(len(t)),
        kl_coef=0.0,
        missing_eos_penalty=1.0,
        stop_strings=["e"],
        max_new_tokens=12,
    )
    stats = trainer.update()
    assert 0.0 < stats["ppo/eos_fraction"] < 1.0
    assert stats["ppo/reward_total_mean"] == pytest.approx(-(1.0 - stats["ppo/eos_fraction"]), abs=1e-6)
    assert stats["ppo/score_mean"] == 0.0  # the raw score is reported before the penalty


@pytest.mark.parametrize(("top_k", "top_p", "warned"), [(0, 1.0, False), (5, 1.0, True), (0, 0.9, True)])
def test_truncated_sampling_warns_that_rollouts_are_off_policy(tok, tmp_path, top_k, top_p, warned):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tok, tmp_path, top_k=top_k, top_p=top_p)
    off_policy = [w for w in caught if "off-policy" in str(w.message)]
    assert len(off_policy) == warned
    if warned:
        assert f"ppo.top_k={top_k}, ppo.top_p={top_p}" in str(off_policy[0].message)


def test_an_eos_id_of_the_generation_config_ends_responses_without_penalty(tok, tmp_path):
    """A policy that always samples the second EOS id its generation_config lists: every response is that one
    token, counted as ended (no missing-EOS penalty), and the score goes on it."""
    newline = tok("\n", add_special_tokens=False)["input_ids"][0]
    policy = tiny_llama(tok, seed=0)
    policy.lm_head = torch.nn.Linear(policy.config.hidden_size, len(tok))
    with torch.no_grad():
        policy.lm_head.weight.zero_()
        policy.lm_head.bias.fill_(-100.0)
        policy.lm_head.bias[newline] = 100.0
    policy.generation_config.eos_token_id = [tok.eos_token_id, newline]
    trainer = make_trainer(
        tok, tmp_path, policy=policy, score_fn=lambda p, t: torch.ones(len(t)), kl_coef=0.0, missing_eos_penalty=1.0
    )
    stats = trainer.update()
    assert stats["ppo/eos_fraction"] == 1.0 and stats["ppo/response_length"] == 1.0
    assert stats["ppo/reward_total_mean"] == pytest.approx(1.0)  # the score, not lowered by the penalty


@pytest.mark.parametrize("normalization", ["whiten", "running"])
def test_reward_normalization(tok, tmp_path, normalization):
    trainer = make_trainer(tok, tmp_path, kl_coef=0.0, reward_normalization=normalization)
    stats = trainer.update()
    assert stats["ppo/reward_total_mean"] == pytest.approx(0.0, abs=1e-5)  # scores centred
    assert stats["ppo/score_mean"] > 0.05  # raw scores are not
    if normalization == "running":
        assert trainer.running_scores.count == 16


def test_sft_reward_normalization_uses_fixed_statistics_of_sft_samples(tok, tmp_path):
    """Before the first update the SFT policy's samples for reward_norm_prompts prompts are scored once; their
    statistics normalise every later score: the SFT samples themselves come out with mean 0 and std 1."""
    calls = []

    def score(prompts, texts):
        calls.append(vowel_fraction(prompts, texts))
        return calls[-1]

    trainer = make_trainer(
        tok, tmp_path, score_fn=score, kl_coef=0.0, reward_normalization="sft", reward_norm_prompts=16
    )
    first = trainer.update()
    sft_scores, rollout_scores = calls
    assert len(sft_scores) == 16 and trainer.sft_scores.count == 16
    normalized = trainer.sft_scores.normalize(sft_scores)
    assert normalized.mean().item() == pytest.approx(0.0, abs=1e-5)
    assert normalized.std(correction=0).item() == pytest.approx(1.0, abs=1e-4)
    assert first["ppo/reward_norm_mean"] == pytest.approx(sft_scores.double().mean().item())
    assert first["ppo/reward_norm_std"] == pytest.approx(sft_scores.double().std(correction=0).item())
    assert first["ppo/reward_total_mean"] == pytest.approx(
        trainer.sft_scores.normalize(rollout_scores).mean().item(), abs=1e-5
    )  # not 0: not this batch's own statistics
    second = trainer.update()
    assert len(calls) == 3  # sampled once
    assert (second["ppo/reward_norm_mean"], second["ppo/reward_norm_std"]) == (
        first["ppo/reward_norm_mean"],
        first["ppo/reward_norm_std"],
    )


@pytest.mark.parametrize("schedule", ["constant", "linear"])
def test_learning_rate_schedule(tok, tmp_path, schedule):
    """linear: lr * (1 - (u - 1) / steps) for update u, 0 once the run is done; constant by default."""
    trainer = make_trainer(tok, tmp_path, steps=4, learning_rate=1e-2, lr_schedule=schedule)
    lrs = [h["ppo/lr"] for h in trainer.train()]
    expected = [1e-2, 0.75e-2, 0.5e-2, 0.25e-2] if schedule == "linear" else [1e-2] * 4
    assert lrs == pytest.approx(expected)
    assert core.learning_rate(1e-2, 5, 4, schedule) == (0.0 if schedule == "linear" else 1e-2)
    assert make_trainer(tok, tmp_path).cfg.lr_schedule == "constant"


def test_adaptive_kl_coefficient_in_the_loop(tok, tmp_path):
    trainer = make_trainer(tok, tmp_path, kl_coef=0.1, adaptive_kl={"enabled": True, "target": 1.0, "horizon": 100})
    first, second = trainer.update(), trainer.update()
    assert first["ppo/kl_coef"] == 0.1
    # KL of the first update is 0 < target: e = -0.2, beta = 0.1 * (1 - 0.2 * 16 / 100)
    assert second["ppo/kl_coef"] == pytest.approx(0.1 * 0.968)


def _without_times(history):
    return [{k: v for k, v in h.items() if not k.startswith("time/")} for h in history]


RESUME_VARIANTS = {
    "shared": dict(reward_normalization="running", adaptive_kl={"enabled": True, "target": 1.0, "horizon": 50}),
    "separate+lora": dict(
        value_model="separate", lora={"enabled": True, "r": 4, "alpha": 8}, learning_rate=5e-2, kl_estimator="k3"
    ),
    "sft-normalization+linear-lr": dict(reward_normalization="sft", reward_norm_prompts=8, lr_schedule="linear"),
}


@pytest.mark.parametrize("variant", list(RESUME_VARIANTS))
def test_resume_equals_uninterrupted_run(tok, tmp_path, variant):
    extra = RESUME_VARIANTS[variant]
    full = make_trainer(tok, tmp_path / "a", steps=6, checkpoint_every=3, **extra)
    full_history = full.train()

    first = make_trainer(tok, tmp_path / "b", steps=6, checkpoint_every=3, **extra)
    for _ in range(3):  # interrupted after its third update
        first.update()
    ckpt_dir = tmp_path / "b" / "ckpt"
    assert [p.name for p in ckpt_dir.iterdir()] == ["step-000003"]
    assert {p.name for p in (ckpt_dir / "step-000003").iterdir()} == {
        ".rlhflow-made",
        "trainable.safetensors",
        "optimizer.pt",
        "rng.pt",
        "trainer_state.json",
    }

    resumed = make_trainer(tok, tmp_path / "b", steps=6, checkpoint_every=3, **extra)
    resumed_history = resumed.train()
    assert resumed.step == 6 and len(resumed_history) == 6
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step-000003", "step-000006"]  # the last two are kept
    for a, b in zip(_without_times(full_history), _without_times(resumed_history)):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    for (name, p), (_, q) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.allclose(p, q, atol=1e-6), name
    assert resumed.kl_ctl.value == pytest.approx(full.kl_ctl.value)
    assert resumed.running_scores.state_dict() == pytest.approx(full.running_scores.state_dict())
    assert resumed.sft_scores.state_dict() == pytest.approx(full.sft_scores.state_dict())


def test_non_finite_score_raises_without_checkpoint(tok, tmp_path):
    calls = []

    def score(prompts, texts):
        calls.append(1)
        return torch.full((len(texts),), float("nan") if len(calls) == 2 else 0.5)

    trainer = make_trainer(tok, tmp_path, score_fn=score, checkpoint_every=1)
    with pytest.raises(NonFiniteError, match="score.*update 2"):
        trainer.train()
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step-000001"]


@pytest.mark.parametrize("quantity,target", [("loss", "value_loss"), ("KL", "kl_per_token")])
def test_non_finite_loss_and_kl_raise(tok, tmp_path, monkeypatch, quantity, target):
    original = getattr(core, target)

    def poisoned(*args, **kwargs):
        out = original(*args, **kwargs)
        return (out[0] * float("inf"), out[1]) if isinstance(out, tuple) else out * float("inf")

    monkeypatch.setattr(core, target, poisoned)
    trainer = make_trainer(tok, tmp_path, checkpoint_every=1)
    with pytest.raises(NonFiniteError, match=f"{quantity} in PPO update 1"):
        trainer.update()
    assert not (tmp_path / "ckpt").exists()


def test_save_writes_a_plain_model_and_value_head(tok, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("rlhflow.progress.PROGRESS_SECONDS", 0.0)  # a progress line after every update
    trainer = make_trainer(tok, tmp_path, steps=2)
    trainer.train()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ppo: ")]
    assert [line.split(":")[1] for line in lines] == [" update 1 of 2", " update 2 of 2"], lines
    assert all(", KL " in line and "reward " in line for line in lines)
    out = trainer.save(tmp_path / "policy")
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, trainer.policy(ids).logits, atol=1e-5)
    head = load_file(str(out / "value_head.safetensors"))
    assert set(head) == {"summary.weight", "summary.bias"}


def test_lora_reference_is_the_adapter_free_base(tok, tmp_path):
    trainer = make_trainer(tok, tmp_path, steps=3, learning_rate=5e-2, lora={"enabled": True, "r": 4, "alpha": 8})
    assert trainer.ref_policy is None  # no second copy of the weights
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or n.startswith("value_head.") for n in trainable)
    history = trainer.train()
    assert history[0]["ppo/kl"] == pytest.approx(0.0, abs=1e-6)  # LoRA B starts at 0: policy == reference
    assert history[-1]["ppo/kl"] > 0.0

    # the reference is still the SFT model
    sft = tiny_llama(tok, seed=0)
    qr = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    am = torch.ones_like(qr)
    with torch.no_grad(), trainer.policy.disable_adapter():
        ref = sequence_logprobs(trainer.policy, qr, am, 4, 1.0)
    assert torch.allclose(ref, sequence_logprobs(sft, qr, am, 4, 1.0), atol=1e-6)

    out = trainer.save(tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.allclose(merged(qr).logits, trainer.policy(input_ids=qr).logits, atol=1e-5)
        assert not torch.allclose(merged(qr).logits, sft(qr).logits, atol=1e-4)


def test_separate_critic_starts_from_the_reward_model_when_it_reads_the_policys_tokens(tok, tmp_path, tiny_model_dir):
    from transformers import AutoModelForSequenceClassification

    from rlhflow.config.params import load_config
    from rlhflow.ppo.reward_and_critic import make_critic
    from rlhflow.training.reward_model import RewardModel

    torch.manual_seed(0)
    rm = RewardModel(
        AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1),
        tok,
        max_length=64,
        mean=0.5,
        std=2.0,
    )
    cfg = load_config(overrides=["ppo.value_model=separate"])
    critic = make_critic(cfg.ppo, rm, tok)
    assert critic is not None
    assert torch.equal(critic.head.summary.weight, rm.model.score.weight / 2.0)

    params = make_trainer(tok, tmp_path, steps=1, value_model="separate").cfg
    trainer = PPOTrainer(
        params, policy=tiny_llama(tok, seed=0), tokenizer=tok, score_fn=vowel_fraction, prompts=PROMPTS, critic=critic
    )
    assert trainer.model.critic is critic  # trained as given, not replaced by a copy of the SFT backbone
    stats = trainer.update()
    assert math.isfinite(stats["ppo/value_loss"])
    assert not torch.equal(critic.head.summary.weight, rm.model.score.weight / 2.0)  # it trained
    with torch.no_grad():  # the reward model itself did not
        fresh = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
        assert all(
            torch.equal(a, b)
            for (n, a), (_, b) in zip(rm.model.base_model.named_parameters(), fresh.base_model.named_parameters())
        )

    # no reward model (a rule-based reward): auto falls back to the SFT copy, reward_model refuses
    assert make_critic(cfg.ppo, None, tok) is None
    strict = load_config(overrides=["ppo.value_model=separate", "ppo.critic_init=reward_model"])
    with pytest.raises(ValueError, match="ppo.critic_init=reward_model: ppo.reward_fn replaces the reward model"):
        make_critic(strict.ppo, None, tok)
    assert make_critic(load_config(overrides=["ppo.value_model=shared"]).ppo, rm, tok) is None


def test_load_reward_fn_binds_its_kwargs_and_rejects_bad_specs():
    from rlhflow.ppo.reward_functions import load_reward_fn

    fn = load_reward_fn("rlhflow.ppo.reward_functions:contains_word", {"word": "hello"})
    assert fn([[], []], ["Hello there", "bye"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="must look like"):
        load_reward_fn("rlhflow.ppo.reward_functions")
    with pytest.raises(ValueError, match="is not a callable"):
        load_reward_fn("rlhflow.ppo.reward_functions:nope")


@pytest.mark.parametrize("detach", [False, True])
def test_shared_value_head_detached_from_the_backbone(tok, tmp_path, detach):
    """value_head_detach: the value loss's gradient stops at the head; without it the backbone gets one too (once
    the head is off its zero start: a zero head passes no gradient back)."""
    trainer = make_trainer(tok, tmp_path, value_head_detach=detach)
    with torch.no_grad():
        trainer.model.value_head.summary.weight.fill_(0.1)
    ids, mask = encode_prompts(tok, [p[-1]["content"] for p in PROMPTS[:4]], 32)
    _, values, _ = trainer.model(ids, mask, ids.shape[1] - 4, 1.0)
    trainer.model.zero_grad(set_to_none=True)
    (values - 1.0).pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.model.value_head.parameters())
    moved = [p for p in trainer.model.policy.parameters() if p.grad is not None and p.grad.abs().sum() > 0]
    assert (moved == []) == detach


@pytest.mark.parametrize("value_model", ["shared", "separate"])
def test_value_model_learns_at_its_own_rate_on_the_same_schedule(tok, tmp_path, value_model):
    trainer = make_trainer(
        tok, tmp_path, value_model=value_model, learning_rate=1e-2, value_learning_rate=1e-3, lr_schedule="linear"
    )
    policy_group, value_group = trainer.optimizer.param_groups
    value_params = {id(p) for p in trainer.model.value_module().parameters()}
    assert {id(p) for p in value_group["params"]} == value_params
    assert not value_params & {id(p) for p in policy_group["params"]}
    trainer.update()
    trainer.update()  # update 2 of 4 on the linear schedule: 0.75 of each group's rate
    assert (policy_group["lr"], value_group["lr"]) == pytest.approx((0.75e-2, 0.75e-3))
    same = make_trainer(tok, tmp_path, value_model=value_model, value_learning_rate=None).optimizer.param_groups
    assert [g["lr"] for g in same] == [1e-2, 1e-2]  # unset: the policy's rate
    assert PPOConfig().value_learning_rate == 1e-3 and PPOConfig().value_head_detach  # the defaults


def test_samples_per_prompt_samples_each_drawn_prompt_that_many_times(tok, tmp_path):
    trainer = make_trainer(tok, tmp_path, batch_size=16, samples_per_prompt=4)
    first, second = trainer._next_prompts(), trainer._next_prompts()
    for idx in (first, second):
        assert len(idx) == 16 and len(set(idx)) == 4
        assert all(idx[g * 4 : g * 4 + 4] == [idx[g * 4]] * 4 for g in range(4))  # groups of one prompt
    one = make_trainer(tok, tmp_path, batch_size=16)._next_prompts()
    assert first[::4] + second[::4] == one[:8]  # the same seeded prompt order, each drawn prompt repeated
    with pytest.raises(ValueError, match="multiple of ppo.samples_per_prompt"):
        PPOConfig(batch_size=8, mini_batch_size=4, samples_per_prompt=3)


def _resume_on_rank(rank: int, init_file: str, ckpt_root: str, out_dir: str) -> None:
    """One of two gloo processes: a trainer whose checkpoint dir is its own (rank 1's is empty, as on a machine that
    does not share rank 0's disk) resumes; it writes what it resumed to out_dir/rank<r>.json."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    from tests.fixtures import tiny_tokenizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        tok = tiny_tokenizer()
        trainer = make_trainer(tok, Path(ckpt_root), batch_size=16, mini_batch_size=8)
        trainer.checkpoint_dir = Path(ckpt_root) / f"rank{rank}"
        resumed = trainer.load_checkpoint()
        weights = sum(float(p.double().sum()) for p in trainer.model.parameters())
        adam = sum(float(s["exp_avg"].double().sum()) for s in trainer.optimizer.state.values())
        state = {"resumed": resumed, "step": trainer.step, "weights": weights, "adam": adam}
        state["queue"] = trainer._prompt_queue
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(state))
    finally:
        dist.destroy_process_group()


def test_resume_in_two_processes_takes_the_main_processs_checkpoint(tok, tmp_path):
    """Rank 0 reads the checkpoint and sends it: rank 1, whose checkpoint dir is empty, resumes the same state."""
    import json

    import torch.multiprocessing as mp

    trainer = make_trainer(tok, tmp_path)
    trainer.update()
    trainer.checkpoint_dir = tmp_path / "rank0"
    trainer.save_checkpoint()
    (tmp_path / "rank1").mkdir()
    mp.spawn(_resume_on_rank, args=(str(tmp_path / "init"), str(tmp_path), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] and ranks[0]["resumed"] and ranks[0]["step"] == 1
    assert ranks[0]["weights"] == pytest.approx(sum(float(p.double().sum()) for p in trainer.model.parameters()))
    assert ranks[0]["queue"] == trainer._prompt_queue
