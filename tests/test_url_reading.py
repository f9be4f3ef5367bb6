"""One reading of a URL for the check and the client: a URL that urllib.parse, urllib3 (requests, MLflow) and httpx
read differently gets no credential; every command that reaches the tracking server checks it first; no credential
follows a redirect to another host; a judge's reply is bounded in time and size; a sweep's grid point is shown
without secrets. "Another host" is 0.0.0.0 in a URL (the rule names 127.0.0.0/8, ::1 and localhost alone as this
machine), which reaches a listener on 127.0.0.1, so a test proves that nothing reaches it and sends to loopback only."""

from __future__ import annotations

import contextlib
import gzip
import http.server
import socket
import threading
import time

import httpx
import pytest

from rlhflow.config import credentials
from rlhflow.config.params import ConfigError, load_config
from rlhflow.evaluation import judges, judging

SECRET = "pw-SECRET-4242"


# A URL naming 0.0.0.0 is another host under the rule (only 127.0.0.0/8, ::1 and localhost are this machine), and
# Linux delivers a connection to it to a listener on 127.0.0.1: the tests send to loopback alone.
ANOTHER_HOST, LISTEN_ON = "0.0.0.0", "127.0.0.1"


class Listener:
    """A socket on another host's address that records every connection and the bytes it received."""

    def __init__(self):
        self.host = ANOTHER_HOST
        self.sock = socket.create_server((LISTEN_ON, 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        self.running = True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while self.running:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(0.5)
                with contextlib.suppress(OSError):
                    self.received.append(conn.recv(65536))

    def close(self):
        self.running = False
        self.thread.join()
        self.sock.close()


@pytest.fixture
def listener():
    elsewhere = Listener()
    yield elsewhere
    elsewhere.close()


@pytest.fixture
def mlflow_gives_up_at_once(monkeypatch):
    """MLflow's own retries (minutes) cut to one quick try: where a request is sent, the test ends in seconds."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "bob")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", SECRET)


@contextlib.contextmanager
def local_server(answer):
    """An HTTP server on 127.0.0.1 (this machine) whose every request gets `answer(handler)`."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            answer(self)

        do_POST = do_GET

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def trickle(handler):
    """A reply of a byte every 0.1 s for 4 s: each read within any timeout, the whole past a second's bound."""
    handler.send_response(200)
    handler.end_headers()
    with contextlib.suppress(OSError):
        for _ in range(40):
            handler.wfile.write(b" ")
            handler.wfile.flush()
            time.sleep(0.1)


def json_reply(body: bytes, encoding: str | None = None):
    """An answer of `body` as JSON, its length declared, `encoding` its Content-Encoding."""

    def answer(handler):
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        if encoding:
            handler.send_header("Content-Encoding", encoding)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        with contextlib.suppress(OSError):
            handler.wfile.write(body)

    return answer


def past_the_bounds():
    """(answer, what the error says) for a reply past 64 KiB plain, one past it once unpacked (4 MiB of spaces in a
    gzip of about 4 kB) and one trickling past a second's bound."""
    return [
        (json_reply(b"{" + b" " * 2**20 + b"}"), "passed 65,536 bytes"),
        (json_reply(gzip.compress(b" " * 2**22), "gzip"), "passed 65,536 bytes"),
        (trickle, "took over 1 s"),
    ]


def redirect_to(location: str):
    def answer(handler):
        handler.send_response(302)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    return answer


# ---- one reading ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.5:5000\\@127.0.0.1:5000/",  # urllib.parse: 127.0.0.1; urllib3, requests: 10.0.0.5
        "https://127.0.0.1\\@10.0.0.5/",  # the other way round
        "http://bob@10.0.0.5@127.0.0.1/",  # two @
        "\thttp://127.0.0.1/",  # a control character urllib.parse strips
        "http://127.0.0.1%2540evil.example/",  # a percent-encoded host
        "https://ex\u0430mple.com/v1",  # a Cyrillic a: a look-alike host
        "http://[::1]@10.0.0.5/",  # a bracketed address in the user info
    ],
)
def test_a_url_clients_read_differently_gets_no_credential(url):
    problem = credentials.transport_problem("judge.endpoint", url, "the API key")
    assert problem and "is refused" in problem and "Clients read such a URL differently" in problem


def test_a_plain_url_reads_alike_and_a_refused_one_fails_at_config_load_even_with_plain_http_allowed():
    for url in ("http://bob:p%40ss@127.0.0.1:5000/", "http://[::1]:8000/v1", "https://api.example.com/v1?v=1"):
        assert credentials.transport_problem("x", url, "the key") is None
        assert len(credentials.readings(url)) == 1
    overrides = ["judge.kind=llm", "judge.model=m", "judge.endpoint=http://10.0.0.5\\@127.0.0.1/v1"]
    with pytest.raises(ConfigError, match="judge.endpoint .* is refused: it holds a backslash"):
        load_config(overrides=[*overrides, "judge.allow_plain_http=true"])
    url = "feedback.label_studio_url=http://bob:pw@10.0.0.5@127.0.0.1:8080"
    with pytest.raises(ConfigError, match="feedback.label_studio_url .* is refused") as err:
        load_config(overrides=[url, "feedback.allow_plain_http=true"])
    assert "pw" not in str(err.value).split("refused")[0]


def test_the_tracking_preflight_sends_nothing_where_the_client_reads_another_host(
    listener, mlflow_gives_up_at_once, monkeypatch
):
    """urllib.parse reads 127.0.0.1 in this URI, requests connects to the other host: refused, nothing sent."""
    from rlhfops.tracking import TrackingUnavailableError, preflight

    uri = f"http://{listener.host}:{listener.port}\\@127.0.0.1:{listener.port}/"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(TrackingUnavailableError, match="is refused: it holds a backslash") as err:
        preflight(load_config())
    assert SECRET not in str(err.value)
    assert listener.received == []


# ---- every command checks the tracking store before it sends --------------------------------------------------


def feedback_collect(cfg):
    from tasks.feedback import run_step

    run_step("collect", cfg)


def feedback_round(cfg):
    from flows.feedback_flow import feedback_round

    feedback_round.fn(config=cfg, sample=False, retrain=False)


def sweep(cfg):
    from flows.sweep_flow import rlhf_sweep

    rlhf_sweep.fn(grid={"ppo.kl_coef": ["0.1"]}, best_of_n=[], config=cfg)


def restore(cfg):
    from rlhfops.restore import restore

    restore("0123456789abcdef", cfg)


@pytest.mark.parametrize("command", [feedback_collect, feedback_round, sweep, restore])
def test_each_command_refuses_a_plain_http_tracking_server_elsewhere_before_it_sends(
    command, listener, mlflow_gives_up_at_once, monkeypatch
):
    from rlhfops import tracking, workspace

    monkeypatch.setattr(workspace, "exclusive", lambda *args, **kwargs: contextlib.nullcontext())
    monkeypatch.setenv("LABEL_STUDIO_API_KEY", "ls-token-123456")
    cfg = load_config(overrides=[f"tracking.tracking_uri=http://{listener.host}:{listener.port}"])
    with pytest.raises(tracking.TrackingUnavailableError, match="MLFLOW_TRACKING_PASSWORD and every run"):
        command(cfg)
    assert listener.received == []


# ---- no credential follows a redirect elsewhere ---------------------------------------------------------------


def test_label_studio_follows_no_redirect_elsewhere_and_its_own_still(listener):
    from rlhfops.labeling import LabelingError, LabelStudio

    def answer(handler):
        if handler.path == "/api/projects":  # Label Studio's own trailing slash: followed
            return redirect_to("/api/projects/")(handler)
        if handler.path == "/api/projects/":
            handler.send_response(200)
            handler.send_header("Content-Length", "2")
            handler.end_headers()
            return handler.wfile.write(b"[]")
        return redirect_to(f"http://{listener.host}:{listener.port}/api/export")(handler)

    with local_server(answer) as url:
        client = LabelStudio(url, "ls-token-SECRET", timeout=5)
        assert client.request("GET", "/api/projects") == []
        with pytest.raises(LabelingError, match=rf"redirected GET \(HTTP 302\) to http://{listener.host}"):
            client.request("GET", "/api/elsewhere")
    assert listener.received == []


def test_the_judge_follows_no_redirect_and_names_it(listener, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-SECRET-judge-123")
    target = f"http://{listener.host}:{listener.port}/v1/chat/completions"
    with local_server(redirect_to(target)) as url:
        settings = load_config(overrides=["judge.kind=llm", "judge.model=m", f"judge.endpoint={url}/v1"]).judge
        judge = judges.LLMJudge(settings)
        with judge.client() as client, pytest.raises(judges.JudgeUnavailableError, match="redirected") as err:
            judge.chat(client, "1 or 2?", retries=0)
    assert f"{listener.host}:{listener.port}" in str(err.value) and "SECRET" not in str(err.value)
    assert listener.received == []


@pytest.fixture
def redirects_unset(monkeypatch):
    """MLFLOW_ALLOW_HTTP_REDIRECTS as a user's shell has it (unset), put back as it was after the test."""
    monkeypatch.setenv("MLFLOW_ALLOW_HTTP_REDIRECTS", "unset")  # records the variable's state for the teardown
    monkeypatch.delenv("MLFLOW_ALLOW_HTTP_REDIRECTS")


def redirect_api_to(listener):
    return redirect_to(f"http://{listener.host}:{listener.port}/api/2.0/mlflow/experiments/search")


def test_the_tracking_client_follows_no_redirect_and_the_preflight_names_it(
    listener, mlflow_gives_up_at_once, redirects_unset
):
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from rlhfops.tracking import TrackingUnavailableError, preflight

    with local_server(redirect_api_to(listener)) as url:
        with pytest.raises(TrackingUnavailableError, match=rf"HTTP 302, a redirect to http://{listener.host}"):
            preflight(load_config(overrides=[f"tracking.tracking_uri={url}"]))
        with pytest.raises(MlflowException, match="302"):  # a stage's own call, after the preflight set the rule
            MlflowClient(url).search_experiments()
    assert listener.received == []


def test_a_tracking_redirect_followed_by_choice_carries_no_credential(listener, mlflow_gives_up_at_once, monkeypatch):
    """With MLFLOW_ALLOW_HTTP_REDIRECTS=true the request goes on to the other host, without the password: requests
    drops an Authorization header on a redirect to another host (and from https to http)."""
    import base64

    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from rlhfops.tracking import check_transport

    monkeypatch.setenv("MLFLOW_ALLOW_HTTP_REDIRECTS", "true")
    with local_server(redirect_api_to(listener)) as url:
        check_transport(url)
        with pytest.raises(MlflowException, match="search"):  # the listener reads the request and hangs up
            MlflowClient(url).search_experiments()
    sent = b"".join(listener.received)
    assert b"/api/2.0/mlflow/experiments/search" in sent  # the request did arrive, and without credentials
    assert b"authorization" not in sent.lower() and base64.b64encode(f"bob:{SECRET}".encode()) not in sent


# ---- a judge's reply, bounded ---------------------------------------------------------------------------------


def llm_judge(timeout: float = 5.0) -> judges.LLMJudge:
    overrides = ["judge.kind=llm", "judge.model=m", "judge.endpoint=http://127.0.0.1:9/v1"]
    return judges.LLMJudge(load_config(overrides=[*overrides, f"judge.request_timeout={timeout}"]).judge)


def replying(chunks, timeout: float = 5.0) -> httpx.Client:
    """A client whose every request is answered HTTP 200 with the body `chunks` yields, pulled as it is read."""
    reply = httpx.MockTransport(lambda request: httpx.Response(200, content=chunks()))
    return httpx.Client(transport=reply, timeout=timeout)


def test_a_judge_reply_that_trickles_past_the_timeout_fails_in_bounded_time():
    def drip():
        for _ in range(100):  # 10 s in all, each byte well within any per-read timeout
            time.sleep(0.1)
            yield b" "
        yield b'{"choices": [{"message": {"content": "1"}}]}'

    judge = llm_judge(timeout=0.5)
    start = time.monotonic()
    with replying(drip, 0.5) as client, pytest.raises(judges.JudgeUnavailableError, match="did not answer"):
        judge.chat(client, "1 or 2?", retries=0)
    assert time.monotonic() - start < 2


def test_a_judge_reply_of_many_megabytes_is_cut_at_the_bound():
    pulled = []

    def flood():
        for _ in range(1024):  # 64 MiB
            pulled.append(1)
            yield b" " * 65536

    with replying(flood) as client, pytest.raises(judges.JudgeUnavailableError, match="ran past 1048576 bytes"):
        llm_judge().chat(client, "1 or 2?", retries=0)
    assert len(pulled) * 65536 <= 2 * judging.MAX_REPLY_BYTES


# ---- a sweep's grid point, shown without secrets --------------------------------------------------------------


def test_a_sweeps_grid_point_is_printed_and_tagged_without_its_secrets(monkeypatch):
    from flows.sweep_flow import PointOutcome, point_label

    monkeypatch.setenv("JUDGE_API_KEY", "sk-SECRET-from-env-123")
    point = ["judge.endpoint=https://bob:pw-SECRET@judge.example/v1?key=k-SECRET", "judge.model=sk-SECRET-from-env-123"]
    outcome = PointOutcome(point, "finished", seed=2)
    for shown in (outcome.label, outcome.run_label, point_label(point, 2)):
        assert "SECRET" not in shown and "judge.endpoint=https://judge.example/v1" in shown


# ---- Label Studio's reply, bounded ----------------------------------------------------------------------------


def test_a_label_studio_reply_past_its_bounds_fails_naming_the_request(monkeypatch):
    """An export read as it arrives: past the byte bound, or trickling past the whole-reply time bound though each
    read comes within its timeout, the request fails naming it; errors show Label Studio's URL without user info."""
    from rlhfops import labeling

    monkeypatch.setattr(labeling, "MAX_REPLY_BYTES", 2**16)
    monkeypatch.setattr(labeling, "MAX_REPLY_SECONDS", 1.0)

    def flood(handler):
        handler.send_response(200)
        handler.send_header("Content-Length", str(2**20))
        handler.end_headers()
        with contextlib.suppress(OSError):
            handler.wfile.write(b"[" + b" " * (2**20 - 2) + b"]")

    with local_server(flood) as url:
        with pytest.raises(labeling.LabelingError, match=r"GET /api/projects/1/export.*passed 65,536 bytes; not read"):
            labeling.LabelStudio(url, "token", timeout=5).tasks(1)
    with local_server(trickle) as url:
        started = time.monotonic()
        with pytest.raises(labeling.LabelingError, match=r"export.*took over 1 s; not read"):
            labeling.LabelStudio(url, "token", timeout=5).tasks(1)
        assert time.monotonic() - started < 3
        with_user = url.replace("http://", f"http://admin:{SECRET}@")
        down = labeling.LabelStudio(with_user.replace(url.rsplit(":", 1)[1], "9"), "token", timeout=5)
        with pytest.raises(labeling.LabelingError, match="is not reachable") as err:
            down.tasks(1)
        assert SECRET not in str(err.value)


def test_a_tracking_servers_reply_past_its_bounds_fails_naming_the_store(mlflow_gives_up_at_once, monkeypatch):
    """MLflow's client reads each reply through rlhfops/store_replies.py: past the byte bound (declared, compressed
    or not) or trickling past the whole-reply time bound though each read comes within MLflow's timeout, the call
    fails naming the store's URL, at once; a reply within the bounds reads as before."""
    from mlflow.exceptions import MlflowException

    from rlhfops import store_replies, tracking

    monkeypatch.setattr(store_replies, "MAX_REPLY_BYTES", 2**16)
    monkeypatch.setattr(store_replies, "MAX_REPLY_SECONDS", 1.0)

    for answer, past in past_the_bounds():
        with local_server(answer) as url:
            started = time.monotonic()
            with pytest.raises(MlflowException, match=rf"{url}/api/2.0/mlflow/experiments/search.* {past}; not read"):
                tracking.client(url).search_experiments()
            assert time.monotonic() - started < 3
    with local_server(json_reply(b'{"experiments": [{"experiment_id": "7", "name": "rlhf"}]}')) as url:
        assert [e.name for e in tracking.client(url).search_experiments()] == ["rlhf"]


def test_a_prefect_servers_reply_past_its_bounds_fails_naming_the_request(monkeypatch):
    """Prefect's clients, async and sync, read each reply through rlhfops/prefect_replies.py (a flow module installs
    it as it loads): past the byte bound (declared, compressed or not) or trickling past the whole-reply time bound,
    the call fails naming the request's URL, at once and asked once; a reply within the bounds reads as before."""
    import asyncio

    from prefect.client.orchestration import PrefectClient, SyncPrefectClient

    import flows.pipeline_flow  # noqa: F401  (what a flow run loads; it installs the bound)
    from rlhfops import prefect_replies

    monkeypatch.setattr(prefect_replies, "MAX_REPLY_BYTES", 2**16)
    monkeypatch.setattr(prefect_replies, "MAX_REPLY_SECONDS", 1.0)

    async def hello_async(api: str):
        async with PrefectClient(api) as client:
            return (await client.hello()).json()

    def hello_sync(api: str):
        with SyncPrefectClient(api) as client:
            return client.hello().json()

    def counted(answer, asked: list):
        return lambda handler: (asked.append(handler.path), answer(handler))

    for hello in (hello_sync, lambda api: asyncio.run(hello_async(api))):
        for answer, past in past_the_bounds():
            asked = []
            with local_server(counted(answer, asked)) as url:
                started = time.monotonic()
                with pytest.raises(prefect_replies.ReplyPastBoundsError, match=rf"to {url}/api/hello {past}; not read"):
                    hello(f"{url}/api")
                assert time.monotonic() - started < 3 and asked == ["/api/hello"]
        with local_server(json_reply(b'"hello"')) as url:
            assert hello(f"{url}/api") == "hello"
