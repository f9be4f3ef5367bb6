"""The evaluation's decoder (rlhflow/models/decoding.py) samples as transformers' generate does, while ended rows leave
the batch and the KV cache."""

import pytest
import torch

from rlhflow.models import decoding
from rlhflow.models.decoding import inverse_cdf_draw, logits_processors, multinomial_draw, sample_dropping_finished
from rlhflow.models.policy import encode_prompts
from tests.fixtures import varied_tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    "hello",
    "Please explain how photosynthesis works in simple terms.",
    "What is the capital of France?",
    "Tell me a story",
    "a",
    "Write three words about the sea, and then stop.",
]


@pytest.fixture(scope="module")
def model(tok):
    return varied_tiny_llama(tok)


def _hf(model, ids, mask, *, stop_ids, max_new_tokens, pad_id, **sampling):
    greedy = sampling.pop("greedy", False)
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=not greedy,
        max_new_tokens=max_new_tokens,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
        **({} if greedy else sampling),
    )


def _a_token_rows_reach_at_different_steps(greedy: torch.Tensor, context: int, pad_id: int) -> int:
    """A token id that the greedy answers first emit at different steps (and some never): as a stop id it ends the
    rows at different steps."""
    firsts: dict[int, set[int]] = {}
    for row in greedy[:, context:].tolist():
        seen = set()
        for step, t in enumerate(row):
            if t not in seen and t != pad_id:
                seen.add(t)
                firsts.setdefault(t, set()).add(step)
    return max(firsts, key=lambda t: (len(firsts[t]), -min(firsts[t])))


@pytest.mark.parametrize("evict_share", [0.0, 0.25, 2.0])  # evict at every end, the default, never
def test_greedy_answers_equal_generate_while_rows_leave(tok, model, monkeypatch, evict_share):
    monkeypatch.setattr(decoding, "EVICT_SHARE", evict_share)
    ids, mask = encode_prompts(tok, PROMPTS, 64)
    pad, P = tok.pad_token_id, ids.shape[1]
    free = _hf(model, ids, mask, stop_ids=[], max_new_tokens=16, pad_id=pad, greedy=True)
    stop = _a_token_rows_reach_at_different_steps(free, P, pad)
    expected = _hf(model, ids, mask, stop_ids=[stop], max_new_tokens=16, pad_id=pad, greedy=True)
    ends = {row.index(stop) for row in expected[:, P:].tolist() if stop in row}
    assert len(ends) >= 2  # rows end at different steps: the batch shrinks while decoding
    got, stopped = sample_dropping_finished(
        model,
        ids,
        mask,
        max_new_tokens=16,
        processors=logits_processors(temperature=1e-6, top_k=0, top_p=1.0, repetition_penalty=1.0),
        stop_ids=[stop],
        pad_id=pad,
    )
    assert got.tolist() == expected.tolist() and stopped == [None] * len(PROMPTS)


def test_sampled_tokens_equal_generate_at_one_seed_while_no_row_ends(tok, model):
    """Same random stream, same processors in the same order (repetition penalty, temperature, top-k, top-p) and
    generate's own draw: the same tokens, as long as the batch keeps all its rows."""
    ids, mask = encode_prompts(tok, PROMPTS, 64)
    settings = dict(temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3)
    torch.manual_seed(5)
    expected = _hf(model, ids, mask, stop_ids=[], max_new_tokens=12, pad_id=tok.pad_token_id, **settings)
    torch.manual_seed(5)
    got, _ = sample_dropping_finished(
        model,
        ids,
        mask,
        max_new_tokens=12,
        processors=logits_processors(**settings),
        stop_ids=[],
        pad_id=tok.pad_token_id,
        draw=multinomial_draw,
    )
    assert got.tolist() == expected.tolist()


@pytest.mark.parametrize("vocab", [50, 700])  # one block of decoding.CDF_BLOCK, and three with a partial last one
def test_the_inverse_cdf_draw_has_the_multinomial_distribution(vocab):
    """Draws from a fixed distribution with zeros in it (what top-k / top-p leave; with 700 tokens a whole block of
    zeros too): each token's frequency within 4.5 standard errors of its probability (chi-square far below its 1e-5
    tail), and no zero-probability token, at the first or last position included; rows need not be normalised."""
    from scipy import stats

    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(vocab, generator=generator) ** 4
    probs[[0, 7, 8, 30, vocab - 1]] = 0.0
    if vocab > 2 * decoding.CDF_BLOCK:
        probs[decoding.CDF_BLOCK : 2 * decoding.CDF_BLOCK] = 0.0
        probs[2 * decoding.CDF_BLOCK + 3] = 0.05 * probs.sum()  # a heavy token in the last, partial block
    probs /= probs.sum()
    n = 400_000
    torch.manual_seed(1)
    draws = inverse_cdf_draw((probs * 3.0).expand(n, -1))
    counts = torch.bincount(draws, minlength=vocab).double()
    assert len(counts) == vocab and counts[probs == 0].sum() == 0
    expected = probs.double() * n
    se = (expected * (1 - probs.double())).sqrt()
    live = probs > 0
    assert ((counts - expected).abs()[live] <= 4.5 * se[live] + 1).all()
    chi2 = ((counts - expected)[live] ** 2 / expected[live]).sum().item()
    assert chi2 < stats.chi2.ppf(1 - 1e-5, int(live.sum()) - 1)
    one_hot = torch.zeros(3, vocab)
    one_hot[0, 0], one_hot[1, vocab - 1], one_hot[2, 17] = 1.0, 1.0, 1.0
    assert inverse_cdf_draw(one_hot).tolist() == [0, vocab - 1, 17]


def test_the_draw_is_part_of_the_sampling_settings_and_reaches_the_decoder(tok, model, monkeypatch):
    """Sampling.draw names the decoder's draw, and the answers' key carries it (answers drawn otherwise are not
    taken for these)."""
    import dataclasses

    from rlhflow.config.params import load_config
    from tasks.evaluation_setup import evaluation_sampling

    used = []
    for name, draw in list(decoding.DRAWS.items()):
        monkeypatch.setitem(decoding.DRAWS, name, lambda probs, name=name, draw=draw: used.append(name) or draw(probs))
    settings = dataclasses.replace(evaluation_sampling(load_config()), max_new_tokens=3, batch_size=4)
    assert settings.key()["draw"] == "inverse_cdf"
    settings.sample(model, tok, PROMPTS[:2])
    assert set(used) == {"inverse_cdf"}
    used.clear()
    other = dataclasses.replace(settings, draw="multinomial")
    other.sample(model, tok, PROMPTS[:2])
    assert set(used) == {"multinomial"} and other.key() != settings.key()
