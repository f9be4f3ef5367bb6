"""What every judge shares, and the llm judge: a judge's verdicts (`Verdicts`), what evaluation asks of a judge
(`Judge`), the settings check that runs before any stage (`preflight`), and `LLMJudge`, a chat model behind an
OpenAI-compatible endpoint asked in both answer orders. Nothing here loads torch or transformers, so a flow checks
its judge without them; the pointwise judges (reward models) and choosing a judge: rlhflow/evaluation/judges.py.
What the llm judge reads (`LLMJudge.render`) and how a verdict is read (`parse_verdict`) are written so that no
answer can steer it; its API key goes only into the request's Authorization header. The whole contract:
docs/evaluation.md, The judge.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import string
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import numpy as np
from huggingface_hub.utils import HFValidationError, validate_repo_id

from rlhflow.config import credentials
from rlhflow.config.params import REPO_ROOT, JudgeConfig
from rlhflow.data.replies import PastBoundsError, read_within
from rlhflow.data.sources import SourceNotFoundError, resolve_model, resolve_source
from rlhflow.redaction import REDACTED, redact_url, redact_urls

log = logging.getLogger(__name__)

Messages = list[dict[str, str]]
DEFAULT_TEMPLATE = Path(__file__).with_name("judge_template.txt")
PLACEHOLDERS = ("instruction", "output_1", "output_2")
VERDICTS = {"1": 1, "2": 2}  # the only replies read as verdicts (after stripping surrounding whitespace)
MAX_TOKENS = 16  # a verdict is one character; the rest shows in the log what a malformed reply said
PREFLIGHT_TIMEOUT_S = 10.0
LLM_WORKERS = 4  # requests in flight at once
MAX_REPLY_BYTES = 1 << 20  # a verdict's reply is a few hundred bytes, an error page a few kB


class ReplyTooLargeError(Exception):
    """The endpoint's reply ran past MAX_REPLY_BYTES."""


def bounded_post(client: httpx.Client, url: str, payload: dict) -> tuple[httpx.Response, bytes]:
    """The response (its status and headers) and body of one POST, the whole reply within the client's read timeout
    (httpx bounds each read only: a server that drips a byte at a time would hold it forever) and MAX_REPLY_BYTES.
    Past the time: httpx.ReadTimeout, past the size: ReplyTooLargeError; either stops reading at once."""
    deadline = time.monotonic() + client.timeout.read  # from the request on, the wait for its headers included
    with client.stream("POST", url, json=payload) as response:
        try:
            return response, read_within(response.iter_bytes(), MAX_REPLY_BYTES, deadline - time.monotonic())
        except PastBoundsError as err:
            if err.size:
                raise ReplyTooLargeError(f"its reply ran past {MAX_REPLY_BYTES} bytes") from None
            raise httpx.ReadTimeout("the whole reply took longer", request=response.request) from None


class JudgeUnavailableError(ValueError):
    """A judge setting cannot be used: the endpoint is unreachable or refuses, the model is not a one-label reward
    model, the template lacks a placeholder. The message names the `judge.*` key (never the API key)."""


@dataclass
class Verdicts:
    """A judge's verdicts on pairs (a, b) of answers, one per prompt. `wins`: 1 a better, 0.5 a tie or split
    verdict, 0 b better. `preference`: the soft preference for a in [0, 1]. `soft`: whether `preference` is graded
    (a pointwise scorer's Bradley-Terry probability) rather than the verdict again (an LLM's or a person's, whose
    preference is the mean of its verdicts). `malformed`: replies that stayed unparseable after retries;
    `malformed_items`: the prompts they were about."""

    wins: np.ndarray
    preference: np.ndarray
    malformed: int = 0
    malformed_items: list[int] = field(default_factory=list)
    soft: bool = False


class Judge:
    """What evaluation asks of a judge. `score` only where `pointwise`; `compare` always."""

    kind: str
    pointwise: bool

    def score(self, prompt_messages: list[Messages], responses: list[str]) -> np.ndarray:
        raise NotImplementedError(f"judge.kind={self.kind} compares pairs of answers only; use compare")

    def compare(self, prompt_messages: list[Messages], answers_a: list[str], answers_b: list[str]) -> Verdicts:
        raise NotImplementedError

    def describe(self) -> dict[str, str]:
        """What the judge is, as MLflow params: kind, model, endpoint (no credentials), template md5."""
        raise NotImplementedError

    def basis_md5(self) -> str:
        """What the champion rule compares: figures are comparable only when measured by judges with equal basis."""
        raise NotImplementedError


def check_reward_model(spec: str) -> None:
    """`judge.model` for kind=reward_model: an existing local dir (or packaged model) whose config has one label, or
    a Hub id of valid form. Reads only the config, never the weights or the network."""

    try:
        source = resolve_source(spec)
    except SourceNotFoundError:
        raise JudgeUnavailableError(f"judge.model={spec}: no such file or directory") from None
    if source.kind == "hub":
        try:
            validate_repo_id(spec)
        except HFValidationError as err:
            raise JudgeUnavailableError(f"judge.model={spec} is neither a local dir nor a Hub id: {err}") from None
        return
    if source.kind == "package":
        try:
            location = Path(resolve_model(spec).location)
        except FileNotFoundError as err:
            raise JudgeUnavailableError(f"judge.model={spec}: {err}") from None
    elif source.kind == "dir":
        location = source.path
    else:
        raise JudgeUnavailableError(f"judge.model={spec} is a file; give the model's directory")
    config_file = location / "config.json"
    if not config_file.is_file():
        raise JudgeUnavailableError(f"judge.model={spec}: {config_file} is missing; not a Hugging Face model dir")
    config = json.loads(config_file.read_text())
    labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2  # transformers' default is 2
    architectures = config.get("architectures") or []
    if labels != 1 or (architectures and not any(a.endswith("ForSequenceClassification") for a in architectures)):
        raise JudgeUnavailableError(
            f"judge.model={spec} is not a reward model: a sequence-classification model with one label (a score) is "
            f"needed; its config has num_labels={labels}, architectures={architectures}"
        )


# ---- the llm judge: a chat model behind an OpenAI-compatible endpoint --------------------------------------------


def parse_verdict(reply: str) -> int | None:
    """1 or 2 when the reply, stripped of surrounding whitespace, is exactly that digit; None (malformed) for anything
    else, however plainly it seems to name an output: a loose reading takes "Output 1 is worse than Output 2" for 1."""
    return VERDICTS.get((reply or "").strip())


_PLACEHOLDER_RULE = (
    f"a template holds {', '.join('{' + p + '}' for p in PLACEHOLDERS)} and no other field, in str.format syntax "
    "(a literal brace is written twice: {{ or }})"
)


_PLACEHOLDER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}")


def check_template(text: str, where: str) -> None:
    """Each placeholder is there, as a bare `{name}` (no conversion or format spec), and no other field is: a value
    meant for one placeholder never lands in another. `where` names the file in the error."""
    try:
        fields = [(name, conv, spec) for _, name, spec, conv in string.Formatter().parse(text) if name is not None]
    except ValueError as err:
        raise JudgeUnavailableError(f"{where}: {err}; {_PLACEHOLDER_RULE}") from None
    unknown = [(name, conv, spec) for name, conv, spec in fields if name not in PLACEHOLDERS or conv or spec]
    if unknown:
        # named by what a placeholder could be called; a field of any other text is counted, never shown: a file that
        # is no template (a JSON file, a key) would otherwise be echoed into the error
        shown = sorted(
            {
                "{" + name + (f"!{conv}" if conv else "") + (":..." if spec else "") + "}"
                for name, conv, spec in unknown
                if _PLACEHOLDER_NAME.fullmatch(name)
            }
        )
        other = len(unknown) - sum(1 for name, _, _ in unknown if _PLACEHOLDER_NAME.fullmatch(name))
        named = ", ".join(shown + ([f"{other} field(s) that are not placeholders"] if other else []))
        raise JudgeUnavailableError(f"{where}: unknown placeholder(s) {named}; {_PLACEHOLDER_RULE}")
    missing = [f"{{{p}}}" for p in PLACEHOLDERS if p not in {name for name, _, _ in fields}]
    if missing:
        raise JudgeUnavailableError(f"{where}: lacks the placeholder(s) {', '.join(missing)}; {_PLACEHOLDER_RULE}")


def load_template(template: str | os.PathLike | None) -> tuple[str, str]:
    """(the template's text, its name): `judge.template` (relative paths from the repository root) or the shipped
    default, its placeholders checked (check_template)."""
    path = DEFAULT_TEMPLATE if template is None else Path(os.path.expanduser(str(template)))
    if not path.is_absolute():
        path = REPO_ROOT / path
    where = f"judge.template={template}" + ("" if str(path) == str(template) else f" ({path})")
    try:
        text = path.read_bytes().decode()  # as the file is (no newline translation): its md5 is the file's
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or err
        raise JudgeUnavailableError(f"{where}: cannot read it ({reason})") from None
    check_template(text, where)
    return text, "default" if template is None else str(template)


# The judge reads the conversation and the answers as JSON rather than inside a fence with a random delimiter: the
# encoding closes each block by construction (every quote and line break inside a value is escaped, so a value is
# one line between its own quotes, whatever it says), and a request stays a function of its inputs, so greedy
# verdicts reproduce and a retry asks the same question.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def as_json(value: Any) -> str:
    """`value` as one line of JSON: non-ASCII text stays readable (ensure_ascii=False), and the line breaks that
    json.dumps then leaves as they are (NEL, U+2028, U+2029) are escaped as well."""
    return json.dumps(value, ensure_ascii=False).translate(_LINE_BREAKS_JSON_KEEPS)


def public_endpoint(endpoint: str) -> str:
    """The endpoint as it is shown, logged and compared: its scheme, host, port and path as rlhflow.redaction shows
    every URL, the host lower-cased and no trailing slash, so the judge's basis stays the same whatever key or
    spelling the URL carries."""
    parts = urlsplit(redact_url(endpoint))
    return urlunsplit((parts.scheme, parts.netloc.lower(), parts.path.rstrip("/"), "", ""))


class LLMJudge(Judge):
    """A chat model behind an OpenAI-compatible endpoint, asked for a pairwise verdict in both orders."""

    kind = "llm"
    pointwise = False

    def __init__(self, settings: JudgeConfig, *, workers: int = LLM_WORKERS):
        self.endpoint, self.model = settings.endpoint, settings.model
        self.api_key_env = settings.api_key_env
        # the rule params.yaml was loaded under, again: built from settings made any other way, it holds too
        what, lift = f"the API key (${self.api_key_env})", "judge.allow_plain_http"
        problem = credentials.variable_problem("judge.api_key_env", self.api_key_env, credentials.JUDGE)
        problem = problem or credentials.transport_problem(
            "judge.endpoint", self.endpoint, what, lift, lifted=settings.allow_plain_http
        )
        if problem:
            raise JudgeUnavailableError(problem)
        self.timeout, self.max_retries = settings.request_timeout, settings.max_retries
        self.template, self.template_name = load_template(settings.template)
        self.workers = workers
        self.requests = 0  # chat requests sent, retries included
        self._lock = threading.Lock()

    # -- what it is

    def template_md5(self) -> str:
        return hashlib.md5(self.template.encode()).hexdigest()

    def describe(self) -> dict[str, str]:
        return {
            "judge/kind": self.kind,
            "judge/model": self.model,
            "judge/endpoint": public_endpoint(self.endpoint),
            "judge/template": self.template_name,
            "judge/template_md5": self.template_md5(),
        }

    def basis_md5(self) -> str:
        key = "\0".join((public_endpoint(self.endpoint), self.model, self.template))
        return hashlib.md5(key.encode()).hexdigest()

    # -- asking

    def render(self, prompt_messages: Messages, output_1: str, output_2: str) -> str:
        """What the judge is asked: the template filled in one pass (str.format_map reads no value for placeholders),
        the conversation as a JSON list of its messages and each answer as a JSON string (as_json)."""
        conversation = [{"role": m["role"], "content": m["content"]} for m in prompt_messages]
        values = {"instruction": as_json(conversation), "output_1": as_json(output_1), "output_2": as_json(output_2)}
        return self.template.format_map(values)

    def _api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) or None

    def _scrub(self, text: str) -> str:
        """An error's text without the key or any URL credential (an endpoint's query key echoed back)."""
        key = self._api_key()
        text = redact_urls(text)
        return text.replace(key, REDACTED) if key else text

    def client(self, timeout: float | None = None) -> httpx.Client:
        key = self._api_key()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        # no redirect followed: the Authorization header would go with it to whatever host it names
        return httpx.Client(headers=headers, timeout=timeout or self.timeout, follow_redirects=False)

    def chat(self, client: httpx.Client, content: str, *, max_tokens: int = MAX_TOKENS, retries: int | None = None):
        """The reply to one user message ("" when the answer has no text). Timeouts, refused connections, HTTP 429
        and 5xx are retried with backoff (`retries`, default judge.max_retries); HTTP 401/403 and other 4xx are not.
        Failing for good raises JudgeUnavailableError naming judge.endpoint."""

        retries = self.max_retries if retries is None else retries
        parts = urlsplit(self.endpoint)  # a query (e.g. ?api-version=...) stays after the path
        url = urlunsplit(parts._replace(path=f"{parts.path.rstrip('/')}/chat/completions"))
        payload = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "temperature": 0,
            "max_tokens": max_tokens,
        }
        shown = public_endpoint(self.endpoint)
        for attempt in range(retries + 1):
            with self._lock:
                self.requests += 1
            try:
                response, body = bounded_post(client, url, payload)
                status = response.status_code
            except httpx.TimeoutException as err:
                problem = f"did not answer within {client.timeout.read} s ({type(err).__name__})"
            except ReplyTooLargeError as err:
                problem = str(err)
                break  # asking again brings the same flood
            except httpx.HTTPError as err:
                problem = f"is unreachable ({type(err).__name__}: {self._scrub(str(err))[:200]})"
            else:
                self._check_not_refused(response, shown)
                if status < 400:
                    return _reply_text(body)
                problem = f"answered HTTP {status}: {self._scrub(body.decode(errors='replace'))[:200]}"
                if status != 429 and status < 500:
                    break  # a bad request or an unknown model: asking again will not help
            if attempt < retries:
                time.sleep(min(2.0**attempt, 30.0))
        raise JudgeUnavailableError(
            f"judge.endpoint {shown} {problem}; check judge.endpoint and judge.model={self.model}"
        )

    def _check_not_refused(self, response: httpx.Response, shown: str) -> None:
        """HTTP 401/403 (the key) and a redirect (never followed: the key goes to judge.endpoint only) end the
        asking at once, with JudgeUnavailableError."""
        status = response.status_code
        if status in (401, 403):
            has_key = "is set" if self._api_key() else "is not set"
            raise JudgeUnavailableError(
                f"judge.endpoint {shown} refused the request (HTTP {status}): the API key "
                f"is read from ${self.api_key_env} (judge.api_key_env), which {has_key}"
            )
        if 300 <= status < 400:
            target = response.request.url.join(response.headers.get("location", ""))
            raise JudgeUnavailableError(
                f"judge.endpoint {shown} redirected the request (HTTP {status}) to {redact_url(str(target))}, which "
                "was not asked: the API key goes to judge.endpoint alone. Set judge.endpoint there if you trust it"
            )

    def verdict(
        self, client: httpx.Client, prompt_messages: Messages, output_1: str, output_2: str
    ) -> tuple[int | None, str]:
        """(1 or 2, the reply); (None, the last reply) when it stayed malformed after judge.max_retries more asks."""
        content = self.render(prompt_messages, output_1, output_2)
        for attempt in range(self.max_retries + 1):
            reply = self.chat(client, content)
            choice = parse_verdict(reply)
            if choice is not None:
                return choice, reply
            log.debug("llm judge: malformed verdict %r (ask %d of %d)", reply[:80], attempt + 1, self.max_retries + 1)
        return None, reply

    def compare(self, prompt_messages: list[Messages], answers_a: list[str], answers_b: list[str]) -> Verdicts:
        check_lengths(prompt_messages, answers_a, answers_b)
        jobs = [(i, swapped) for i in range(len(prompt_messages)) for swapped in (False, True)]

        with self.client() as client:

            def ask(job: tuple[int, bool]) -> tuple[float | None, str]:
                """The preference for a of one order (None: malformed), and the reply."""
                i, swapped = job
                first, second = (answers_b[i], answers_a[i]) if swapped else (answers_a[i], answers_b[i])
                choice, reply = self.verdict(client, prompt_messages[i], first, second)
                return (None if choice is None else float((choice == 1) != swapped)), reply

            pool = ThreadPoolExecutor(max_workers=max(1, min(self.workers, len(jobs))))
            try:
                answered = list(pool.map(ask, jobs))
            finally:
                pool.shutdown(cancel_futures=True)

        results = [preference for preference, _ in answered]
        by_order = np.array([0.5 if r is None else r for r in results], dtype=float).reshape(-1, 2)
        preference = by_order.mean(axis=1) if len(by_order) else np.zeros(0)
        wins = np.where(preference == 1.0, 1.0, np.where(preference == 0.0, 0.0, 0.5))
        malformed = [(i, reply) for (i, _), (r, reply) in zip(jobs, answered) if r is None]
        items = sorted({i for i, _ in malformed})
        if malformed:
            log.warning(
                "llm judge: %d of %d replies were not exactly 1 or 2 after %d retries (counted as ties), on prompts "
                "%s; "
                "e.g. malformed verdict %r",
                len(malformed),
                len(jobs),
                self.max_retries,
                items[:20],
                malformed[0][1][:80],
            )
        return Verdicts(wins=wins, preference=preference, malformed=len(malformed), malformed_items=items)


def _reply_text(body: bytes) -> str:
    """The reply's text; "" (a malformed verdict) for anything but a chat completion whose content is a string (a
    number, a list of parts, null)."""
    try:
        content = json.loads(body)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return ""
    return content if isinstance(content, str) else ""


def check_lengths(prompt_messages, answers_a, answers_b) -> None:
    if not len(prompt_messages) == len(answers_a) == len(answers_b):
        raise ValueError(
            f"compare needs one answer of each side per prompt: {len(prompt_messages)} prompts, "
            f"{len(answers_a)} and {len(answers_b)} answers"
        )


def preflight(settings: JudgeConfig, timeout: float = PREFLIGHT_TIMEOUT_S) -> None:
    """Fail in seconds, before any stage runs, when the judge cannot be used. llm: the template loads and one tiny
    chat request is answered within `timeout` (an unreachable endpoint, HTTP 401/403 or an unknown model fail at
    once, naming judge.endpoint). reward_model: the local dir exists and its config has one label, or the Hub id is
    of valid form. trained: nothing (the judge stage trains it)."""
    if settings.kind == "reward_model":
        check_reward_model(settings.model)
    elif settings.kind == "llm":
        judge = LLMJudge(settings)
        with judge.client(timeout=min(timeout, judge.timeout)) as client:
            judge.chat(client, "Reply with the single character 1.", max_tokens=1, retries=0)
