"""The KV cache written in place (rlhflow/models/kv_cache.py) gives the same tokens and logits as transformers'
DynamicCache, in transformers' generate and in the evaluation's decoder while ended rows leave the batch."""

import pytest
import torch

from rlhflow.models import decoding, kv_cache
from rlhflow.models.decoding import logits_processors, sample_dropping_finished
from rlhflow.models.generation import generate
from rlhflow.models.kv_cache import PreallocatedLayer, compile_config, compiled_rows, new_kv_cache, static_capacity
from rlhflow.models.policy import encode_prompts
from tests.fixtures import varied_tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["hello", "Please explain how photosynthesis works.", "What is the capital of France?", "a"]


@pytest.fixture(scope="module")
def model(tok):
    return varied_tiny_llama(tok)


def test_a_layer_writes_in_place_and_shows_the_filled_part():
    layer = PreallocatedLayer(capacity=5)
    first = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)
    keys, values = layer.update(first, -first)
    assert keys.shape == (2, 1, 3, 2) and torch.equal(keys, first) and torch.equal(values, -first)
    step = torch.full((2, 1, 1, 2), 7.0)
    keys, _ = layer.update(step, step)
    assert layer.get_seq_length() == 4 and torch.equal(keys[:, :, 3], step[:, :, 0])
    assert keys.data_ptr() == layer.key_buffer.data_ptr()  # a view: nothing was copied
    layer.batch_select_indices(torch.tensor([1]))
    assert torch.equal(layer.keys, torch.cat([first[1:], step[1:]], dim=2)) and layer.get_seq_length() == 4
    with pytest.raises(ValueError, match="holds 5 positions; this step needs 6"):
        layer.update(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))


def test_an_unknown_cache_is_named():
    with pytest.raises(ValueError, match="unknown kv_cache 'static'"):
        new_kv_cache("static", 8)


def test_generate_samples_the_same_tokens_and_logits_with_either_cache(tok, model):
    """transformers' generate (PPO's rollouts), same seed: the same answers and the same logits to every bit."""
    ids, mask = encode_prompts(tok, PROMPTS, 32)
    outs = {
        kind: generate(
            model,
            tok,
            ids,
            mask,
            max_new_tokens=12,
            temperature=0.7,
            generator_seed=3,
            return_logits=True,
            kv_cache=kind,
        )
        for kind in ("dynamic", "preallocated")
    }
    assert torch.equal(outs["dynamic"].query_response, outs["preallocated"].query_response)
    assert torch.equal(outs["dynamic"].logits, outs["preallocated"].logits)


def _sample(model, tok, ids, mask, *, stop_ids, kv_cache, greedy=False):
    """The decoder's answers at seed 11: sampled at temperature 0.7, 24 tokens; greedy (top-k 1): 16 tokens."""
    torch.manual_seed(11)
    processors = logits_processors(
        temperature=1.0 if greedy else 0.7, top_k=int(greedy), top_p=1.0, repetition_penalty=1.0
    )
    got, _ = sample_dropping_finished(
        model,
        ids,
        mask,
        max_new_tokens=16 if greedy else 24,
        processors=processors,
        stop_ids=stop_ids,
        pad_id=tok.pad_token_id,
        kv_cache=kv_cache,
    )
    return got


def _a_token_rows_first_draw_at_different_steps(answers: torch.Tensor) -> int:
    firsts: dict[int, set[int]] = {}
    for row in answers.tolist():
        for step, token in enumerate(row):
            if row.index(token) == step:
                firsts.setdefault(token, set()).add(step)
    return max(firsts, key=lambda token: len(firsts[token]))


@pytest.mark.parametrize("evict_share", [0.0, 2.0])  # rows leave at every end, and never
def test_the_decoder_samples_the_same_tokens_with_either_cache(tok, model, monkeypatch, evict_share):
    """The evaluation's decoder, same seed, rows ending at different steps and leaving the cache: the same tokens."""
    monkeypatch.setattr(decoding, "EVICT_SHARE", evict_share)
    ids, mask = encode_prompts(tok, PROMPTS * 2, 32)
    free = _sample(model, tok, ids, mask, stop_ids=[], kv_cache="dynamic")
    stop = _a_token_rows_first_draw_at_different_steps(free[:, ids.shape[1] :])
    got = {kind: _sample(model, tok, ids, mask, stop_ids=[stop], kv_cache=kind) for kind in ("dynamic", "preallocated")}
    lengths = {(row[ids.shape[1] :] != tok.pad_token_id).sum().item() for row in got["dynamic"]}
    assert len(lengths) >= 3  # rows ended at different steps, or ran to the limit
    assert torch.equal(got["dynamic"], got["preallocated"])


def _stop_token_for_varied_lengths(model, tok, ids, mask) -> int:
    free = _sample(model, tok, ids, mask, stop_ids=[], kv_cache="preallocated", greedy=True)
    return _a_token_rows_first_draw_at_different_steps(free[:, ids.shape[1] :])


def _graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_the_compiled_decoder_draws_the_eager_tokens_when_greedy(tok, model, monkeypatch):
    """The decode step under torch.compile on a StaticCache, 6 rows in a batch of 8 that shrinks to 4, 2 and 1 as
    rows end: the same greedy tokens as the eager decoder. The graphs are captured and traced as inductor's are, but
    run by aot_eager: inductor's code generation, a minute for these four shapes on a CPU, is checked once below
    (transformers' generate)."""
    monkeypatch.setattr(kv_cache, "COMPILE_BACKEND", "aot_eager")
    ids, mask = encode_prompts(tok, (PROMPTS * 2)[:6], 32)
    stop = _stop_token_for_varied_lengths(model, tok, ids, mask)
    eager = _sample(model, tok, ids, mask, stop_ids=[stop], kv_cache="preallocated", greedy=True)
    before = _graphs_compiled()
    compiled = _sample(model, tok, ids, mask, stop_ids=[stop], kv_cache="compiled", greedy=True)
    assert _graphs_compiled() > before  # the step ran compiled, not eager
    lengths = {(row[ids.shape[1] :] != tok.pad_token_id).sum().item() for row in eager}
    assert len(lengths) >= 3
    assert torch.equal(eager, compiled)


@pytest.mark.slow
@pytest.mark.system
def test_transformers_generate_compiles_with_the_compiled_cache(tok, model):
    """PPO's rollouts (transformers' generate, keeping the sampling pass's logits): the same greedy tokens and
    close logits with the step compiled."""
    ids, mask = encode_prompts(tok, PROMPTS, 32)
    torch._dynamo.reset()  # nothing compiled by the test before
    outs = {
        kind: generate(
            model, tok, ids, mask, max_new_tokens=10, top_k=1, generator_seed=3, return_logits=True, kv_cache=kind
        )
        for kind in ("preallocated", "compiled")
    }
    assert _graphs_compiled() > 0
    assert torch.equal(outs["preallocated"].query_response, outs["compiled"].query_response)
    torch.testing.assert_close(outs["preallocated"].logits, outs["compiled"].logits, rtol=1e-4, atol=1e-4)


def test_the_compiled_shapes_come_in_a_few_sizes_and_cuda_uses_graphs():
    assert [compiled_rows(n) for n in (1, 2, 3, 5, 48)] == [1, 2, 4, 8, 64]
    assert [static_capacity(n) for n in (1, 64, 65, 230)] == [64, 64, 128, 256]
    assert compile_config(torch.device("cuda")).mode == "reduce-overhead"  # CUDA graphs
    assert compile_config(torch.device("cpu")).mode is None
    assert compile_config(torch.device("cpu"))._compile_all_devices  # transformers compiles on a CPU only when told


@pytest.mark.slow
@pytest.mark.system
def test_ppo_rollouts_with_the_compiled_cache_draw_the_eager_tokens(tok, tmp_path):
    """One PPO rollout, greedy (top-k 1), with the step compiled and eager: the same responses and old log-probs."""
    from tests.test_ppo_trainer import make_trainer

    batches = {
        kind: make_trainer(tok, tmp_path / kind, top_k=1, kv_cache=kind, precision="fp32")._rollout(1)[0]
        for kind in ("preallocated", "compiled")
    }
    assert torch.equal(batches["preallocated"]["query_response"], batches["compiled"]["query_response"])
    torch.testing.assert_close(batches["preallocated"]["logprobs"], batches["compiled"]["logprobs"])
