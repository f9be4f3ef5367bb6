"""How much a tracking server's reply may cost. MLflow's client reads every reply whole, bounded per read only
(`MLFLOW_HTTP_REQUEST_TIMEOUT`): a server that answered a search with gigabytes, or dripped a byte per read timeout,
would hold the run's memory or time without end. `bound_mlflow_replies` gives every requests session MLflow's client
makes a response hook that reads the reply as it arrives, before requests would read it whole: at most
MAX_REPLY_BYTES (decoded), within MAX_REPLY_SECONDS in all. Replies streamed to a file (artifact downloads, sized by
what the run logged) are left to MLflow.
"""

from __future__ import annotations

import functools

import requests
from mlflow.utils import request_utils

from rlhflow.data.replies import PastBoundsError, read_within
from rlhflow.redaction import redact_url

# a search_runs page of 1,000 runs with their params, metrics and tags is a few MB; a model's metadata a few kB
MAX_REPLY_BYTES = 256 * 2**20
MAX_REPLY_SECONDS = 300.0
READ_SIZE = 2**16


class ReplyPastBoundsError(requests.exceptions.RequestException):
    """A tracking server's reply ran past MAX_REPLY_BYTES or MAX_REPLY_SECONDS; the rest was not read."""


def bounded_reply(response: requests.Response, *args, stream: bool = False, **kwargs) -> requests.Response:
    """A requests response hook: the body read now, as it arrives (requests calls hooks before it reads the body of
    a request that is not streamed), and held as the response's content; past a bound, the connection is closed
    and ReplyPastBoundsError raised. MLflow reports it as the request's failure, naming the URL."""
    if stream:
        return response
    chunks = iter(lambda: response.raw.read1(READ_SIZE, decode_content=True), b"")
    try:
        response._content = read_within(chunks, MAX_REPLY_BYTES, MAX_REPLY_SECONDS)  # what .content, .json() read
    except PastBoundsError as err:
        response.close()
        shown = redact_url(response.url)
        raise ReplyPastBoundsError(f"the reply from {shown} {err}; not read", response=response) from None
    return response


def bound_mlflow_replies() -> None:
    """Every requests session MLflow's client takes from now on (mlflow.utils.request_utils, where each of its REST
    calls gets one) reads its replies through bounded_reply. Idempotent."""
    sessions = request_utils._get_request_session
    if getattr(sessions, "bounded", False):
        return

    @functools.wraps(sessions)
    def bounded_sessions(*args, **kwargs) -> requests.Session:
        session = sessions(*args, **kwargs)  # cached by MLflow per process and settings: the hook goes on once
        if bounded_reply not in session.hooks["response"]:
            session.hooks["response"].append(bounded_reply)
        return session

    bounded_sessions.bounded = True
    request_utils._get_request_session = bounded_sessions
