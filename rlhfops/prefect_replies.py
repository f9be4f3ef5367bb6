"""How much a Prefect server's reply may cost. Prefect's clients (httpx) read every reply whole, bounded per read
only: a server that answered with gigabytes, or dripped a byte per read timeout, would hold a flow's memory or time
without end. `bound_prefect_replies` gives every client Prefect makes from then on (its async and sync httpx
clients, whoever builds them: the engine, a task's concurrency slot, the project's own calls) a response hook that
reads the reply as it arrives, before httpx would read it whole: at most MAX_REPLY_BYTES (decoded), within
MAX_REPLY_SECONDS in all. Prefect streams no reply, so every reply goes through it.

The modules that talk to Prefect call `bound_prefect_replies()` as they load (flows/*_flow.py, and
rlhfops/training_slot.py before a stage takes its slot).
"""

from __future__ import annotations

import functools

import httpx
from prefect.client.base import PrefectHttpxAsyncClient, PrefectHttpxSyncClient

from rlhflow.data.replies import PastBoundsError, ReplyBound
from rlhflow.redaction import redact_url

# a page of flow runs, task runs or logs is a few hundred kB; a deployment's schema a few kB
MAX_REPLY_BYTES = 256 * 2**20
MAX_REPLY_SECONDS = 300.0


class ReplyPastBoundsError(httpx.TransportError):
    """A Prefect server's reply ran past MAX_REPLY_BYTES or MAX_REPLY_SECONDS; the rest was not read. A transport
    error that Prefect's client does not retry (it retries timeouts and broken connections by their own classes)."""


def _past_bounds(response: httpx.Response, err: PastBoundsError) -> ReplyPastBoundsError:
    shown = redact_url(str(response.request.url))
    return ReplyPastBoundsError(f"the Prefect server's reply to {shown} {err}; not read", request=response.request)


async def bounded_async_reply(response: httpx.Response) -> None:
    """An httpx response hook of the async client: the body read now, as it arrives, and held as the response's
    content (what httpx's own read then returns); past a bound, ReplyPastBoundsError (httpx closes the response)."""
    bound = ReplyBound(MAX_REPLY_BYTES, MAX_REPLY_SECONDS)
    try:
        async for chunk in response.aiter_bytes():
            bound.add(chunk)
    except PastBoundsError as err:
        raise _past_bounds(response, err) from None
    response._content = bytes(bound.body)


def bounded_sync_reply(response: httpx.Response) -> None:
    """`bounded_async_reply` for the sync client."""
    bound = ReplyBound(MAX_REPLY_BYTES, MAX_REPLY_SECONDS)
    try:
        for chunk in response.iter_bytes():
            bound.add(chunk)
    except PastBoundsError as err:
        raise _past_bounds(response, err) from None
    response._content = bytes(bound.body)


def _with_hook(init, hook):
    @functools.wraps(init)
    def bounded_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        hooks = self.event_hooks
        self.event_hooks = {**hooks, "response": [*hooks.get("response", []), hook]}

    bounded_init.bounded = True
    return bounded_init


def bound_prefect_replies() -> None:
    """Every Prefect client made from now on reads its replies through the hooks above. Idempotent."""
    for cls, hook in ((PrefectHttpxAsyncClient, bounded_async_reply), (PrefectHttpxSyncClient, bounded_sync_reply)):
        if not getattr(cls.__init__, "bounded", False):
            cls.__init__ = _with_hook(cls.__init__, hook)
