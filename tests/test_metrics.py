"""Evaluation metrics against values computed by hand."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from rlhflow.evaluation.metrics import (
    confidence_buckets,
    distinct_n,
    expected_calibration_error,
    kendall_tau,
    mean_length,
    ranking_agreement,
    ranking_from_pairs,
    repetition_rate,
    response_nll,
    win_rate,
)


def test_length_distinct_and_repetition():
    assert mean_length(["a b", "c d e f"]) == 3.0
    # unigrams a b a b c: 3 distinct of 5; bigrams (a b) (b a) (b c): all distinct
    assert distinct_n(["a b a", "b c"], 1) == pytest.approx(0.6)
    assert distinct_n(["a b a", "b c"], 2) == 1.0
    # "a b a b a b": bigrams ab ba ab ba ab -> 2 distinct of 5 -> 0.6 repeated; "x y z": none; "q": no bigram, skipped
    assert repetition_rate(["a b a b a b", "x y z", "q"], n=2) == pytest.approx(0.3)
    assert repetition_rate(["the cat sat on the mat"]) == 0.0  # seq-rep-4
    assert repetition_rate(["go on and on and on and on"]) == pytest.approx(1 - 3 / 5)


def test_win_rate_counts_ties_half():
    assert win_rate(torch.tensor([1.0, 0.0, 2.0, 1.0]), torch.tensor([0.0, 0.0, 3.0, 1.0])) == pytest.approx(0.5)


def test_confidence_buckets_and_calibration_error():
    # sigmoid(|margin|): 2 -> 0.881 (right, then wrong), 0.1 -> 0.525 (right), 0 -> 0.5 (tie: half), 3 -> 0.953
    buckets = confidence_buckets([2.0, -2.0, 0.1, 0.0, 3.0])
    assert [(b.label, b.pairs) for b in buckets] == [("50_60", 2), ("80_90", 2), ("90_100", 1)]
    low, mid, high = buckets
    assert low.confidence == pytest.approx((1 / (1 + math.exp(-0.1)) + 0.5) / 2)
    assert (low.accuracy, mid.accuracy, high.accuracy) == (0.75, 0.5, 1.0)
    assert mid.confidence == pytest.approx(1 / (1 + math.exp(-2)))
    expected = 0.4 * abs(0.75 - low.confidence) + 0.4 * abs(0.5 - mid.confidence) + 0.2 * abs(1 - high.confidence)
    assert expected_calibration_error(buckets) == pytest.approx(expected)
    assert expected_calibration_error(buckets) == pytest.approx(0.2568, abs=1e-4)


def test_ranking_from_pairs_needs_one_consistent_total_order():
    assert ranking_from_pairs([("a", "b"), ("b", "c")]) == {"a": 0, "b": 1, "c": 2}
    assert ranking_from_pairs([("b", "c"), ("a", "b"), ("a", "c")]) == {"a": 0, "b": 1, "c": 2}
    assert ranking_from_pairs([("a", "b"), ("a", "c")]) is None  # b and c unordered
    assert ranking_from_pairs([("a", "b"), ("b", "c"), ("c", "a")]) is None  # contradictory


def test_kendall_tau_by_hand_and_against_scipy():
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    assert kendall_tau([1, 2, 3], [3, 2, 1]) == -1.0
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)  # one discordant pair of six
    assert kendall_tau([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / math.sqrt(6))  # tau-b: a tie in x
    from scipy.stats import kendalltau

    rng = random.Random(0)
    for _ in range(20):
        x = [rng.randint(0, 4) for _ in range(7)]
        y = [rng.randint(0, 4) for _ in range(7)]
        expected = kendalltau(x, y).statistic
        assert kendall_tau(x, y) == pytest.approx(expected) or (math.isnan(expected) and math.isnan(kendall_tau(x, y)))


def test_ranking_agreement_uses_only_prompts_with_a_total_ranking_of_three_or_more():
    rows = [
        {"prompt": "p", "chosen": "a", "rejected": "b"},
        {"prompt": "p", "chosen": "b", "rejected": "c"},
        {"prompt": "q", "chosen": "x", "rejected": "y"},
        {"prompt": "q", "chosen": "x", "rejected": "z"},
        {"prompt": "r", "chosen": "u", "rejected": "v"},
    ]
    scores = {
        ("p", "a"): 3.0,
        ("p", "b"): 1.0,
        ("p", "c"): 2.0,
        ("q", "x"): 1.0,
        ("q", "y"): 0.0,
        ("q", "z"): 0.0,
        ("r", "u"): 1.0,
        ("r", "v"): 0.0,
    }
    # p: human a > b > c, scores a > c > b: concordant (a,b) (a,c), discordant (b,c) -> 1/3; q unordered; r only two
    tau, prompts = ranking_agreement(rows, scores)
    assert prompts == 1 and tau == pytest.approx(1 / 3)
    tau, prompts = ranking_agreement(rows[2:], scores)
    assert prompts == 0 and math.isnan(tau)


def test_win_rate_interval_on_known_cases():
    from rlhflow.evaluation.metrics import wins
    from rlhflow.evaluation.stats import mean_interval, resample_weights, wilson_interval

    ones, zeros = torch.ones(50), torch.zeros(50)
    indices = resample_weights(50)
    # every prompt won: a percentile bootstrap would collapse to (1, 1); the Wilson interval stands in
    assert mean_interval(wins(ones, zeros), indices) == (1.0, *wilson_interval(50, 50))
    assert wilson_interval(50, 50)[0] == pytest.approx(0.929, abs=1e-3) and wilson_interval(50, 50)[1] == 1.0
    assert mean_interval(wins(zeros, zeros), indices)[0] == 0.5  # ties count half
    # 400 prompts, half won: the binomial 95% interval is 0.5 +- 1.96 * sqrt(0.25 / 400) = 0.451 .. 0.549
    policy = torch.tensor([1.0, 0.0] * 200)
    rate, low, high = mean_interval(wins(policy, torch.full((400,), 0.5)), resample_weights(400, resamples=4000))
    assert rate == 0.5 and low == pytest.approx(0.451, abs=0.01) and high == pytest.approx(0.549, abs=0.01)
    assert resample_weights(400, seed=3).tolist() == resample_weights(400, seed=3).tolist()  # seeded


def test_wilson_interval_matches_the_textbook_values():
    from rlhflow.evaluation.stats import wilson_interval

    # 5 of 10 at 95%: 0.2366 .. 0.7634 (Wilson 1927; e.g. Brown, Cai, DasGupta 2001)
    low, high = wilson_interval(5, 10)
    assert low == pytest.approx(0.2366, abs=1e-4) and high == pytest.approx(0.7634, abs=1e-4)
    assert wilson_interval(0, 20)[0] == pytest.approx(0.0, abs=1e-12) and 0 < wilson_interval(0, 20)[1] < 0.2
    assert all(math.isnan(x) for x in wilson_interval(0, 0))


def test_the_length_rule_and_the_paired_difference():
    from rlhflow.evaluation.stats import difference_interval, resample_weights, shorter_answer_correct

    chosen = ["short", "a much longer chosen answer", "same length", "tiny"]
    rejected = ["a longer rejected answer", "no", "equal words", "big one here"]
    assert shorter_answer_correct(chosen, rejected).tolist() == [1.0, 0.0, 0.5, 1.0]
    model = [1.0, 1.0, 1.0, 0.0]
    diff, low, high = difference_interval(model, shorter_answer_correct(chosen, rejected), resample_weights(4))
    assert diff == pytest.approx((3 - 2.5) / 4) and low <= diff <= high


def test_the_length_controlled_win_rate_removes_a_pure_length_effect():
    """A judge that prefers the longer answer, and nothing else: the raw win rate follows the lengths, the
    length-controlled one stays near 0.5 whatever the share of longer answers."""
    from rlhflow.evaluation.stats import length_controlled_win_rate, resample_weights

    rng = np.random.default_rng(0)
    for longer_share in (0.3, 0.8):
        n = 400
        difference = np.where(rng.random(n) < longer_share, 1.0, -1.0) * rng.integers(1, 30, n)
        p_win = 1 / (1 + np.exp(-3.0 * np.tanh(difference / difference.std())))  # no effect at zero difference
        outcome = (rng.random(n) < p_win).astype(float)
        lc = length_controlled_win_rate(outcome, difference, resample_weights(n, resamples=300))
        raw = outcome.mean()
        assert abs(raw - 0.5) > 0.12  # the raw win rate is mostly length
        assert lc.supported and lc.low < 0.5 < lc.high and abs(lc.value - 0.5) < 0.1
    # a policy better at equal length keeps its edge
    difference = rng.normal(0, 10, 400)
    outcome = (rng.random(400) < 0.75).astype(float)
    lc = length_controlled_win_rate(outcome, difference, resample_weights(400, resamples=300))
    assert lc.value == pytest.approx(0.75, abs=0.06) and lc.low > 0.6
    # every prompt won: finite, near 1
    lc = length_controlled_win_rate(np.ones(20), np.arange(20.0), resample_weights(20, resamples=50))
    assert 0.9 < lc.value < 1 and lc.low <= lc.value <= lc.high


def test_a_models_accuracy_where_the_chosen_answer_is_shorter_longer_and_under_length_control():
    """Per side of the length rule, by hand with Wilson intervals; the length-controlled accuracy is the model's
    preference at equal length: about 0.5 for the length rule itself, the model's own accuracy for one that does not
    look at length."""
    from rlhflow.evaluation.pairs import length_aware_pair_metrics
    from rlhflow.evaluation.stats import wilson_interval

    # 200 pairs: the chosen answer shorter in 120 (by 1 to 30 words), longer in 80
    words = [-(1 + i % 30) for i in range(120)] + [1 + i % 30 for i in range(80)]
    rows = [{"chosen": "w " * (40 + d), "rejected": "w " * 40} for d in words]
    blind = [float(i % 5 != 0) for i in range(200)]  # right on 4 pairs of 5, on either side
    metrics = length_aware_pair_metrics(blind, rows)
    assert metrics["pairs_chosen_shorter"] == 120 and metrics["pairs_chosen_longer"] == 80
    assert metrics["accuracy_chosen_shorter"] == 96 / 120 and metrics["accuracy_chosen_longer"] == 64 / 80
    low, high = wilson_interval(64, 80)
    assert (metrics["accuracy_chosen_longer_ci_low"], metrics["accuracy_chosen_longer_ci_high"]) == (low, high)
    assert metrics["accuracy_lc"] == pytest.approx(0.8, abs=0.05) and metrics["accuracy_lc_supported"] == 1.0
    assert metrics["accuracy_lc_ci_low"] < 0.8 < metrics["accuracy_lc_ci_high"]

    rule = [1.0] * 120 + [0.0] * 80  # the length rule: right exactly where the chosen answer is the shorter
    metrics = length_aware_pair_metrics(rule, rows)
    assert (metrics["accuracy_chosen_shorter"], metrics["accuracy_chosen_longer"]) == (1.0, 0.0)
    assert abs(metrics["accuracy_lc"] - 0.5) < 0.1 and metrics["accuracy_lc_ci_low"] < 0.5
    # a reward model's Bradley-Terry preference, sigmoid(r_c - r_r), is the soft scale, named apart: the accuracies
    # and their length control count the model's choices, not its confidence
    hard = length_aware_pair_metrics(blind, rows)
    soft = length_aware_pair_metrics(blind, rows, preference=[0.9 if b else 0.3 for b in blind])
    assert {k: soft[k] for k in hard} == hard and not any(k.startswith("soft_") for k in hard)
    assert soft["soft_accuracy"] == pytest.approx(0.9 * 0.8 + 0.3 * 0.2)
    assert soft["soft_accuracy_lc"] == pytest.approx(0.9 * 0.8 + 0.3 * 0.2, abs=0.05)
    assert soft["soft_accuracy_lc_ci_low"] < soft["soft_accuracy_lc"] < soft["soft_accuracy_lc_ci_high"]


def test_response_nll_appends_eos_only_to_a_response_that_fits(tok):
    """A reference response cut at max_response_length did not end there: it is scored without EOS. One that fits
    is scored with its EOS."""
    from rlhflow.models.policy import encode_prompts, sequence_logprobs
    from tests.fixtures import tiny_llama

    model = tiny_llama(tok)
    prompt = [[{"role": "user", "content": "hello"}]]
    response = "Thank you for asking! I am happy to help."
    ids = tok(response, add_special_tokens=False)["input_ids"]

    def nll_of(tokens: list[int]) -> float:
        query, mask = encode_prompts(tok, prompt, 256)
        qr = torch.cat([query, torch.tensor([tokens])], dim=1)
        am = torch.cat([mask, torch.ones(1, len(tokens), dtype=mask.dtype)], dim=1)
        return -float(sequence_logprobs(model, qr, am, query.shape[1]).sum())

    nll, n = response_nll(model, tok, prompt, [response], max_response_length=len(ids) + 1)
    assert n == len(ids) + 1 and nll == pytest.approx(nll_of(ids + [tok.eos_token_id]), rel=1e-5)
    for cut in (len(ids), 4):
        nll, n = response_nll(model, tok, prompt, [response], max_response_length=cut)
        assert n == cut and nll == pytest.approx(nll_of(ids[:cut]), rel=1e-5)


def test_response_nll_does_not_depend_on_the_batching(tok):
    """Rows batched by length, or in the given order, in batches of any size: the same sum of NLLs (up to the
    rounding of each row's forward pass) and the same token count."""
    from tests.fixtures import tiny_llama

    model = tiny_llama(tok)
    prompts = [[{"role": "user", "content": "hi " * n}] for n in (9, 1, 5, 2, 14)]
    answers = ["a b c d e f g", "yes", "no, thanks " * 4, "maybe so", "ok"]
    one_by_one = response_nll(model, tok, prompts, answers, batch_size=1)
    for batch_size in (2, 5):
        for by_length in (True, False):
            nll, n = response_nll(model, tok, prompts, answers, batch_size=batch_size, by_length=by_length)
            assert n == one_by_one[1] and nll == pytest.approx(one_by_one[0], rel=1e-6)


def test_saved_held_out_perplexity_is_taken_only_for_the_rows_it_measured(tmp_path):
    from rlhflow.evaluation.metrics import save_held_out_perplexity, saved_held_out_perplexity

    data = tmp_path / "test.jsonl"
    data.write_text('{"prompt": "a"}\n')
    model_dir = tmp_path / "sft"
    model_dir.mkdir()
    assert saved_held_out_perplexity(model_dir, rows=4, data_file=data) is None  # nothing saved
    save_held_out_perplexity(model_dir, 12.5, rows=4, data_file=data)
    assert saved_held_out_perplexity(model_dir, rows=4, data_file=data) == 12.5
    assert saved_held_out_perplexity(model_dir, rows=8, data_file=data) is None  # other rows
    data.write_text('{"prompt": "b"}\n')
    assert saved_held_out_perplexity(model_dir, rows=4, data_file=data) is None  # the split changed


def test_sampled_kl_is_response_kl_of_each_row_whatever_the_batching(tok):
    """The rows of two sampling batches, regrouped by length (or not) into other batches: each response's KL is
    the one response_kl gives on its sampling batch, up to the rounding of the forward pass."""
    from rlhflow.evaluation.metrics import response_kl, sampled_kl
    from rlhflow.models.sampling import sample_responses
    from tests.fixtures import tiny_llama

    policy, reference = tiny_llama(tok), tiny_llama(tok, seed=1)
    prompts = [[{"role": "user", "content": "hi " * n}] for n in (9, 1, 5, 2, 14)]
    outputs = sample_responses(
        policy, tok, prompts, batch_size=3, max_prompt_length=64, max_new_tokens=6, temperature=1.0, seed=0
    )
    per_batch = torch.cat(
        [
            response_kl(policy, reference, o.query_response, o.attention_mask, o.context_length, o.response_mask, 1.0)
            for o in outputs
        ]
    )
    assert per_batch.abs().sum() > 0  # two different models
    for batch_size, by_length in ((2, True), (4, False), (5, True)):
        kl = sampled_kl(
            policy, reference, outputs, 1.0, pad_token_id=tok.pad_token_id, batch_size=batch_size, by_length=by_length
        )
        torch.testing.assert_close(kl, per_batch.double(), rtol=1e-5, atol=1e-5)


def test_the_first_rows_are_answered_as_sampling_every_prompt_answers_them(tok, capsys):
    """Sampling the first `rows` prompts alone (a held-out split that leads another) gives each of their answers as
    sampling every prompt does: their batches are sampled whole, on the same random streams; later batches are not
    sampled. Each part's KL (`parts`) is the same whether or not the other part is scored beside it."""
    from rlhflow.evaluation.metrics import sampled_kl
    from rlhflow.models.sampling import sample_responses
    from rlhflow.progress import ProgressLines
    from tests.fixtures import tiny_llama

    policy, reference = tiny_llama(tok), tiny_llama(tok, seed=1)
    prompts = [[{"role": "user", "content": "hi " * n}] for n in (9, 1, 5, 2, 14, 3, 7)]
    settings = dict(batch_size=3, max_prompt_length=64, max_new_tokens=6, temperature=1.0, seed=0)
    every = sample_responses(policy, tok, prompts, **settings)
    first = sample_responses(policy, tok, prompts, rows=4, lines=ProgressLines("sft_answers", every=0), **settings)
    said = capsys.readouterr().out.splitlines()  # progress lines: each decoding step of each batch sampled
    assert said[0] == "sft_answers: answers: batch 1 of 2, token 1 of 6, 3 of 3 still sampling", said
    assert all(
        line.startswith(("sft_answers: answers: batch 1 of 2", "sft_answers: answers: batch 2 of 2")) for line in said
    )
    assert [len(o.texts) for o in every] == [3, 3, 1] and [len(o.texts) for o in first] == [3, 1]
    assert sum((o.texts for o in first), []) == sum((o.texts for o in every), [])[:4]
    for got, want in zip(first, every):
        rows = len(got.texts)
        assert torch.equal(got.response, want.response[:rows]) and torch.equal(got.ended, want.ended[:rows])
        assert torch.equal(got.query_response, want.query_response[:rows])
    kl = dict(pad_token_id=tok.pad_token_id, batch_size=2)
    both = sampled_kl(policy, reference, every, 1.0, parts=[4, 3], **kl)
    alone = sampled_kl(policy, reference, first, 1.0, parts=[4], **kl)
    assert torch.equal(both[:4], alone)  # to every digit: the first part was batched alone both times
    with pytest.raises(ValueError, match="parts of 5 rows for 7 answers"):
        sampled_kl(policy, reference, every, 1.0, parts=[4, 1], **kl)


def test_scoring_batches_are_as_wide_as_their_longest_row():
    """A scoring batch holds each row's prompt and response left-padded as one: as wide as its longest row (not its
    longest prompt plus its longest response), with every row's response, and nothing else, under its mask."""
    from rlhflow.evaluation.metrics import _batches_by_length

    queries = [[5, 6, 7, 8, 9, 10], [11], [12, 13, 14]]
    answers = [[1], [2, 3, 4, 20, 21], []]
    (rows, query_response, attention, context_length, response_mask), *rest = _batches_by_length(
        queries, answers, 0, 3, False, "cpu"
    )
    assert not rest and rows == [0, 1, 2]
    assert query_response.shape == (3, 7)  # the longest row: 6 + 1 tokens (not 6 + 5)
    assert context_length == 7 - 5  # the last 5 columns hold every response
    for i, row in enumerate(rows):
        window = query_response[i, context_length:]
        assert window[response_mask[i].bool()].tolist() == answers[row]
        assert query_response[i][attention[i].bool()].tolist() == queries[row] + answers[row]
    # a response with no prompt token before it still has a context column to be predicted from
    (_, query_response, _, context_length, response_mask), *_ = _batches_by_length([[]], [[3, 4]], 0, 1, True, "cpu")
    assert context_length == 1 and query_response[0, 1:].tolist() == [3, 4] and response_mask.tolist() == [[1, 1]]
