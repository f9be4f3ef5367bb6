"""Prompt encoding, sampling and log-probabilities on the tiny Llama."""

import copy

import pytest
import torch
from transformers import GenerationConfig

from rlhflow.models.generation import _cut_response, eos_token_ids, generate
from rlhflow.models.logits import entropy_from_logits
from rlhflow.models.packed_linear import packed_linears
from rlhflow.models.policy import Critic, PolicyAndValue, encode_prompts, pad_sequences, sequence_logprobs
from tests.fixtures import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tok):
    return tiny_llama(tok)


MESSAGES = [
    [{"role": "user", "content": "hello"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Please explain how photosynthesis works in simple terms."},
    ],
]


def test_encode_prompts_left_pads_with_generation_prompt(tok):
    ids, mask = encode_prompts(tok, MESSAGES, max_prompt_length=512)
    assert ids.shape == mask.shape and ids.shape[0] == 2
    short = int(mask[0].sum())
    assert mask[0, : ids.shape[1] - short].sum() == 0 and (ids[0, : ids.shape[1] - short] == tok.pad_token_id).all()
    for row in ids:
        assert tok.decode(row).endswith("<|im_start|>assistant\n")  # add_generation_prompt
    full = tok.apply_chat_template(MESSAGES[1], add_generation_prompt=True, tokenize=False)
    assert tok.decode(ids[1]) == full


def test_encode_prompts_truncates_from_the_left(tok):
    ids, mask = encode_prompts(tok, MESSAGES, max_prompt_length=6)
    assert ids.shape[1] == 6 and mask.all()
    full = tok(
        tok.apply_chat_template(MESSAGES[1], add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )["input_ids"]
    assert ids[1].tolist() == full[-6:]


def test_encode_prompts_plain_text_without_template(tok):
    plain = copy.deepcopy(tok)
    plain.chat_template = None
    ids, mask = encode_prompts(plain, [[{"role": "user", "content": "hello world"}], "thanks"], 64)
    assert plain.decode(ids[0][mask[0].bool()]) == "hello world"
    assert plain.decode(ids[1][mask[1].bool()]) == "thanks"


def _left_padded_batch(tok):
    """Two sequences of different prompt and response lengths, as PPO builds them."""
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    responses = [[20, 21, 22], [23, 24, 25, 26, 27]]
    P, T = max(map(len, prompts)), max(map(len, responses))
    qr = torch.full((2, P + T), tok.pad_token_id)
    am = torch.zeros((2, P + T), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        qr[i, P - len(p) : P], am[i, P - len(p) : P] = torch.tensor(p), 1
        qr[i, P : P + len(r)], am[i, P : P + len(r)] = torch.tensor(r), 1
    return prompts, responses, qr, am, P


def test_logprobs_of_left_padded_batch_equal_each_sequence_alone(tok, model):
    prompts, responses, qr, am, P = _left_padded_batch(tok)
    batch_lp, batch_ent = sequence_logprobs(model, qr, am, P, temperature=0.7, return_entropy=True)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        alone = torch.tensor([p + r])
        lp = sequence_logprobs(model, alone, torch.ones_like(alone), len(p), temperature=0.7)
        assert torch.allclose(batch_lp[i, : len(r)], lp[0], atol=1e-5)
        assert (batch_lp[i, len(r) :] == 0).all()  # padding is 0
        # and by hand: log_softmax(logits / T) at the positions that predict each response token
        logits = model(alone).logits[0, len(p) - 1 : -1] / 0.7
        manual = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        assert torch.allclose(lp[0], manual, atol=1e-5)
        assert torch.allclose(batch_ent[i, : len(r)], entropy_from_logits(logits), atol=1e-5)


def test_chunked_logprobs_equal_unchunked(tok, model):
    _, _, qr, am, P = _left_padded_batch(tok)
    full = sequence_logprobs(model, qr, am, P, 1.0)
    assert torch.allclose(sequence_logprobs(model, qr, am, P, 1.0, chunk_size=1), full, atol=1e-6)


def test_policy_and_value_shared_and_separate(tok, model):
    _, responses, qr, am, P = _left_padded_batch(tok)
    expected = sequence_logprobs(model, qr, am, P, 0.7)
    for mode in ("shared", "separate"):
        pv = PolicyAndValue(copy.deepcopy(model), mode)
        lp, values, ent = pv(qr, am, P, 0.7, return_entropy=True)
        assert torch.allclose(lp, expected, atol=1e-5)
        assert values.shape == lp.shape and (values == 0).all()  # zero-initialised head
        assert ent.shape == lp.shape and (ent[0, len(responses[0]) :] == 0).all()
    critic = Critic.from_policy(model)
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(critic.backbone.parameters(), model.parameters()))


def test_critic_from_the_reward_model_starts_at_its_normalised_score(tok, tiny_model_dir):
    """V(s) at a token = the reward model's (score - mean) / std read there; the critic owns a copy of the weights."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).eval()
    _, _, qr, am, P = _left_padded_batch(tok)
    ids = qr[:1, am[0].bool()]  # one sequence, no padding: the reward model reads its last token
    mean, std = 0.3, 2.0
    critic = Critic.from_reward_model(rm, mean=mean, std=std)
    with torch.no_grad():
        expected = (rm(input_ids=ids).logits[:, 0] - mean) / std
        value_at_last = critic.head(critic.backbone(input_ids=ids).last_hidden_state[:, -1])
    assert torch.allclose(value_at_last, expected, atol=1e-5) and expected.abs().item() > 1e-3
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(critic.backbone.parameters(), rm.parameters()))
    with pytest.raises(ValueError, match="no per-token linear score head"):
        Critic.from_reward_model(torch.nn.Module())


def test_generate_shapes_padding_and_seeding(tok, model):
    ids, mask = encode_prompts(tok, MESSAGES * 3, 64)
    state = torch.get_rng_state()
    out = generate(model, tok, ids, mask, max_new_tokens=10, temperature=1.0, generator_seed=123)
    assert torch.equal(torch.get_rng_state(), state)  # a seeded call leaves the global RNG alone
    again = generate(model, tok, ids, mask, max_new_tokens=10, temperature=1.0, generator_seed=123)
    assert torch.equal(out.query_response, again.query_response) and out.texts == again.texts
    B, T = out.response.shape
    assert B == 6 and T <= 10 and out.context_length == ids.shape[1]
    assert torch.equal(out.query_response[:, : ids.shape[1]], ids)
    assert torch.equal(out.attention_mask, torch.cat([mask, out.response_mask], 1))
    for i in range(B):
        n = int(out.response_mask[i].sum())
        assert out.response_mask[i, :n].all()  # real tokens form a prefix
        assert (out.response[i, n:] == tok.pad_token_id).all()
        if out.ended[i]:
            assert out.response[i, n - 1] == tok.eos_token_id
        else:
            assert n == 10 and tok.eos_token_id not in out.response[i].tolist()
        assert out.texts[i] == tok.decode(out.response[i, :n], skip_special_tokens=True)


def test_packed_linears_compute_the_plain_layers(tok, model):
    """Inside the block every Linear runs on a packed copy of its weight with the same result; on exit the plain
    modules are back; with gradients on, the plain path runs (the packed kernel has no autograd)."""
    _, _, qr, am, P = _left_padded_batch(tok)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        plain = model(input_ids=qr, attention_mask=am).logits
        with packed_linears(model, batch_size=qr.shape[0]) as n_packed:
            assert all("forward" in m.__dict__ for m in linears)
            packed = model(input_ids=qr, attention_mask=am).logits
    assert n_packed == len(linears) > 0 and not any("forward" in m.__dict__ for m in linears)
    assert torch.allclose(packed, plain, atol=1e-5) and not torch.equal(packed, torch.zeros_like(packed))
    with packed_linears(model):
        out = model(input_ids=qr, attention_mask=am).logits
    assert out.requires_grad and torch.allclose(out, plain, atol=1e-6)
    with packed_linears(model, enabled=False) as n_packed:
        assert n_packed == 0


def test_packed_lora_layers_merge_the_adapter_and_leave_the_reference_alone(tok, model):
    """A LoRA layer packs W + scaling * B A: the same output as peft's three matmuls; with the adapter disabled (PPO's
    reference) the base model's output."""
    from peft import LoraConfig, get_peft_model

    _, _, qr, am, P = _left_padded_batch(tok)
    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, param in lora.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)  # peft starts B at 0: make the adapter change the output
    with torch.no_grad():
        with_adapter = lora(input_ids=qr, attention_mask=am).logits
        base = model(input_ids=qr, attention_mask=am).logits
        with packed_linears(lora, batch_size=qr.shape[0]) as n_packed:
            packed = lora(input_ids=qr, attention_mask=am).logits
            with lora.disable_adapter():
                packed_base = lora(input_ids=qr, attention_mask=am).logits
    plain_linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert n_packed == plain_linears  # each LoRA layer counts once, its base and adapter layers not again
    assert not torch.allclose(with_adapter, base, atol=1e-3)
    assert torch.allclose(packed, with_adapter, atol=1e-5) and torch.allclose(packed_base, base, atol=1e-5)


@pytest.mark.parametrize("mode", ["shared", "separate"])
def test_rollout_statistics_from_generation_equal_a_forward_pass(tok, model, mode):
    """Old log-probs, entropy and values kept from the sampling pass equal those of a forward pass over the
    sampled sequences (left-padded prompts, responses of different lengths), up to rounding."""
    ids, mask = encode_prompts(tok, MESSAGES * 4, 64)
    pv = PolicyAndValue(copy.deepcopy(model), mode)
    torch.nn.init.normal_(pv.value_module().head.summary.weight if mode == "separate" else pv.value_head.summary.weight)
    gen = generate(
        pv.policy,
        tok,
        ids,
        mask,
        max_new_tokens=12,
        temperature=0.7,
        stop_strings=["e"],
        generator_seed=3,
        return_logits=True,
        return_hidden=mode == "shared",
    )
    assert gen.response_mask.sum(1).unique().numel() > 1  # responses of different lengths
    qr, am, P = gen.query_response, gen.attention_mask, gen.context_length
    with torch.no_grad():
        expected = pv(qr, am, P, 0.7, return_entropy=True)
        values = pv.critic(qr, am, P) if mode == "separate" else None
    got = pv.from_generation(gen, 0.7, values)
    for name, a, b in zip(("logprobs", "values", "entropy"), got, expected):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5), name
        assert (a[gen.response_mask == 0] == 0).all() and a.abs().sum() > 0, name


@pytest.mark.parametrize("drop_finished", [False, True])  # transformers' generate, the evaluation's decoder
def test_generate_stops_at_stop_strings(tok, model, drop_finished):
    ids, mask = encode_prompts(tok, MESSAGES * 4, 64)
    out = generate(
        model,
        tok,
        ids,
        mask,
        max_new_tokens=12,
        temperature=1.0,
        stop_strings=["e"],
        generator_seed=0,
        drop_finished=drop_finished,
    )
    assert out.ended.any()  # "e" is common enough in 12 random tokens
    for i in range(len(out.texts)):
        n = int(out.response_mask[i].sum())
        kept = out.response[i, :n].tolist()
        assert (out.response[i, n:] == tok.pad_token_id).all()
        if out.ended[i] and kept[-1] != tok.eos_token_id:
            assert "e" in tok.decode(kept) and "e" not in tok.decode(kept[:-1])  # cut at the completing token
            assert "e" not in out.texts[i] and tok.decode(kept).startswith(out.texts[i])
        elif not out.ended[i]:
            assert n == 12
        assert "e" not in out.texts[i]


def test_cut_response_rules(tok):
    ids = tok("hello world yes no", add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    # no EOS, no stop string: everything kept, not ended
    assert _cut_response(tok, ids, {eos}, []) == (len(ids), False, "hello world yes no")
    # EOS: kept up to and including it
    assert _cut_response(tok, ids[:2] + [eos] + ids[2:], {eos}, []) == (3, True, tok.decode(ids[:2]))
    # stop string: kept up to the token completing it, text cut before it
    keep, ended, text = _cut_response(tok, ids, {eos}, ["yes"])
    assert (
        ended
        and text == "hello world "
        and "yes" in tok.decode(ids[:keep])
        and "yes" not in tok.decode(ids[: keep - 1])
    )
    # EOS before the stop string wins
    assert _cut_response(tok, ids[:1] + [eos] + ids[1:], {eos}, ["yes"])[:2] == (2, True)


def _forced_token_model(tok, model, token_id: int):
    """A copy of the tiny model that samples `token_id` at every step, whatever the temperature."""
    forced = copy.deepcopy(model)
    head = torch.nn.Linear(forced.config.hidden_size, len(tok), bias=True)
    torch.nn.init.zeros_(head.weight)
    with torch.no_grad():
        head.bias.fill_(-100.0)
        head.bias[token_id] = 100.0
    forced.lm_head = head
    return forced


def test_every_eos_id_of_the_generation_config_ends_a_response(tok, model):
    """Instruct models list several EOS ids in generation_config (Llama-3: <|eot_id|> besides <|end_of_text|>): a
    response ends at any of them, as at the tokenizer's EOS; the token is kept and counted as ended."""
    newline = tok("\n", add_special_tokens=False)["input_ids"][0]
    two_eos = _forced_token_model(tok, model, newline)
    two_eos.generation_config.eos_token_id = [tok.eos_token_id, newline]
    assert eos_token_ids(tok, two_eos) == eos_token_ids(tok, two_eos.generation_config) == [tok.eos_token_id, newline]
    assert eos_token_ids(tok, model) == eos_token_ids(tok) == [tok.eos_token_id]  # an int, or nothing listed
    ids, mask = encode_prompts(tok, MESSAGES, 64)
    out = generate(two_eos, tok, ids, mask, max_new_tokens=4, generator_seed=0)
    assert out.response.tolist() == [[newline]] * 2 and out.response_mask.tolist() == [[1]] * 2
    assert out.ended.all()


def test_stop_string_across_the_prompt_boundary_ends_the_response_without_keeping_padding(tok, model):
    """Row 0's prompt ends with "\\n": its first "\\n" completes the stop string "\\n\\n" (transformers stops the row
    there and pads it); row 1 completes it with its second token. Neither keeps padding as response tokens."""
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    assert newline == [201]
    rows = [
        tok("hello x\n", add_special_tokens=False)["input_ids"],
        tok("hello x", add_special_tokens=False)["input_ids"],
    ]
    ids, mask = pad_sequences(rows, tok.pad_token_id, side="left")
    forced = _forced_token_model(tok, model, newline[0])
    out = generate(forced, tok, ids, mask, max_new_tokens=6, stop_strings=["\n\n"], generator_seed=0)
    assert out.response.tolist() == [[201, tok.pad_token_id], [201, 201]]
    assert out.response_mask.tolist() == [[1, 0], [1, 1]]  # the padding after row 0's stop is not response
    assert out.ended.tolist() == [True, True]
    assert out.texts == ["", ""]  # cut before the stop string, which began in the prompt for row 0


def test_cut_response_counts_stop_strings_that_end_in_the_response(tok):
    ids = tok("s no", add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    # "ye" ends the prompt: the response's first token completes "yes"
    assert _cut_response(tok, ids, {eos}, ["yes"], prompt_tail="hello ye") == (1, True, "")
    # a stop string wholly inside the prompt does not count
    assert _cut_response(tok, ids, {eos}, ["yes"], prompt_tail="yes hello") == (len(ids), False, "s no")
    # generation stopped after 2 tokens (a stop string transformers matched): the rest is padding, never kept
    padded = ids[:2] + [tok.pad_token_id] * 3
    assert _cut_response(tok, padded, {eos}, ["zzz"], stopped_after=2) == (2, True, tok.decode(ids[:2]))


def _with_generation_defaults(model, **fields):
    """A copy of `model` whose own generation_config sets logits processors that would change sampling."""
    configured = copy.deepcopy(model)
    for key, value in fields.items():
        setattr(configured.generation_config, key, value)
    return configured


@pytest.mark.parametrize("lora", [False, True])
def test_the_models_generation_config_does_not_change_sampling(tok, model, lora):
    """Sampling draws from softmax(logits / T) (with our top-k / top-p only) whatever the model's generation_config
    says: the same tokens as a model without one from the same seed, and the sampling pass's log-probs equal those of
    a plain forward pass. Also through a peft model (PPO with LoRA), whose generate passes on the base model's
    generation_config."""
    configured = _with_generation_defaults(
        model,
        min_p=0.5,
        repetition_penalty=2.0,
        no_repeat_ngram_size=1,
        typical_p=0.2,
        epsilon_cutoff=0.01,
        suppress_tokens=list(range(100, 300)),
        bad_words_ids=[[74], [261]],
        min_new_tokens=12,
        top_k=3,
        begin_suppress_tokens=[201],
        forced_bos_token_id=5,
        renormalize_logits=True,
    )
    plain = copy.deepcopy(model)
    plain.generation_config = GenerationConfig()
    if lora:  # a fresh adapter (B = 0) leaves the outputs as they are
        from peft import LoraConfig, get_peft_model

        configured = get_peft_model(configured, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    ids, mask = encode_prompts(tok, MESSAGES * 4, 64)
    kwargs = dict(max_new_tokens=12, temperature=0.7, generator_seed=5, return_logits=True)
    got, expected = generate(configured, tok, ids, mask, **kwargs), generate(plain, tok, ids, mask, **kwargs)
    assert torch.equal(got.query_response, expected.query_response)
    assert any(100 <= t < 300 for t in got.response.flatten().tolist())  # suppressed by the config, sampled anyway
    pv = PolicyAndValue(configured, "shared")
    qr, am, P = got.query_response, got.attention_mask, got.context_length
    with torch.no_grad():
        forward_logprobs = sequence_logprobs(configured, qr, am, P, 0.7)
    assert torch.allclose(
        pv.from_generation(got, 0.7, torch.zeros_like(forward_logprobs))[0], forward_logprobs, atol=1e-5
    )


def test_suppressed_tokens_and_an_early_eos_can_be_sampled(tok, model):
    ids, mask = encode_prompts(tok, MESSAGES, 64)
    newline = _with_generation_defaults(
        _forced_token_model(tok, model, 201), suppress_tokens=[201], begin_suppress_tokens=[201], bad_words_ids=[[201]]
    )
    out = generate(newline, tok, ids, mask, max_new_tokens=3, generator_seed=0)
    assert out.response.tolist() == [[201] * 3] * 2
    eos = _with_generation_defaults(_forced_token_model(tok, model, tok.eos_token_id), min_new_tokens=3, min_length=50)
    out = generate(eos, tok, ids, mask, max_new_tokens=3, generator_seed=0)
    assert out.response.tolist() == [[tok.eos_token_id]] * 2 and out.ended.all()
