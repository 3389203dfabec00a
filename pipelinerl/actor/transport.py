"""The actor's HTTP client: httpx's API (every caller, its timeouts and exceptions) over aiohttp's connection pool.

A profile of the tiny run's actor found half its CPU in httpx's own transport (httpcore): its pool re-scans every
connection and every waiting request at each request and response (`_assign_requests_to_connections`, with a
socket query per connection), which grows with the requests in flight (actor.max_groups_in_flight). aiohttp's
pool hands a free connection out in constant time. `httpx_aiohttp.AiohttpTransport` (the OpenAI SDK's aiohttp
transport) does the translation; `Transport` adds one thing: the httpx exception of each aiohttp failure is the
one httpx's own transport raises for it. The actor tells a connection a live server closed under a request
(RemoteProtocolError, ReadError, WriteError: retried at once, client.py `_dropped_by_live`) from a dead server
(ConnectError) and a timeout, and httpx_aiohttp maps every aiohttp connection error to ConnectTimeout.

Thousands of requests in flight (tools/bench_actor_scale.py: 10,000 episodes, one request each) need what the
process's defaults do not give:
- a socket each. Under the usual soft limit of 1,024 open files, 2,000 episodes made the actor's requests fail
  with "Too many open files" (a ConnectError: the server was set aside as if it had failed) and then the listing
  of RUN_DIR/servers/, which stopped the actor. `ready_process` raises the soft limit to the hard limit (what a
  process may do without privileges) and `actor_client` gives the requests half of it (`ActorClient.slots`): a
  request waits for a slot (client.py `_post`, before it picks a server, so the wait counts in no timeout), and
  the other half is left to everything else (the servers' /status probes, which take no slot, environment
  sessions, files);
- fewer garbage collections. Every object of a request in flight outlives the collector's young generations,
  so with the default thresholds (700, 10, 10) they all reached the oldest one, and full collections, each over
  every open episode, followed one another: 10,000 episodes of two turns ran 26 of them, in pauses of up to
  0.7 s, and 9.0 s in all collections of the actor's 23.7 s of CPU. With GC_THRESHOLDS, which `ready_process`
  sets: 4 full collections, 2.1 s in all.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import resource
from collections.abc import AsyncIterator

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

log = logging.getLogger(__name__)

NR_OPEN = 1 << 20  # Linux's default fs.nr_open: the most a soft limit may be when the hard limit is unlimited
# Young generations of at most 20,000 x 10 objects: their collections took 25 ms on average at 10,000 episodes.
GC_THRESHOLDS = (20_000, 10, 10)


def httpx_error(err: BaseException) -> type[httpx.TransportError] | None:
    """The httpx exception httpx's own transport raises for the aiohttp failure `err` (None: not one to map)."""
    if isinstance(err, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)):  # no reply, or a short body
        return httpx.RemoteProtocolError
    if isinstance(err, aiohttp.ClientConnectorError):
        return httpx.ConnectError
    if isinstance(err, aiohttp.SocketTimeoutError):
        return httpx.ReadTimeout
    if isinstance(err, aiohttp.ClientOSError):  # a connection reset mid-exchange
        return httpx.ReadError
    return None


def _remapped(err: httpx.TransportError, request: httpx.Request) -> httpx.TransportError:
    kind = httpx_error(err.__cause__) if err.__cause__ is not None else None
    return kind(str(err.__cause__) or repr(err.__cause__), request=request) if kind is not None else err


class _Body(httpx.AsyncByteStream):
    """A response body whose read failures are remapped like the request's."""

    def __init__(self, inner: httpx.AsyncByteStream, request: httpx.Request):
        self.inner, self.request = inner, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.inner:
                yield chunk
        except httpx.TransportError as err:
            raise _remapped(err, self.request) from err.__cause__

    async def aclose(self) -> None:
        await self.inner.aclose()


class Transport(AiohttpTransport):
    """AiohttpTransport with httpx's own exceptions (see the module); `limits` as httpx.Limits."""

    def __init__(self, limits: httpx.Limits):
        def session() -> aiohttp.ClientSession:  # made on first use, inside the running event loop
            connector = aiohttp.TCPConnector(limit=limits.max_connections or 0,  # 0: no limit, as httpx's None
                                             keepalive_timeout=limits.keepalive_expiry)
            return aiohttp.ClientSession(connector=connector)

        super().__init__(limits=limits, client=session)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response = await super().handle_async_request(request)
        except httpx.TransportError as err:
            raise _remapped(err, request) from err.__cause__
        response.stream = _Body(response.stream, request)
        return response


class ActorClient(httpx.AsyncClient):
    """An httpx client with `slots`: at most `max_requests` of the requests that take one are in flight."""

    def __init__(self, max_requests: int, **kwargs):
        super().__init__(**kwargs)
        self.max_requests, self.slots = max_requests, asyncio.Semaphore(max_requests)


def request_slot(http: httpx.AsyncClient) -> contextlib.AbstractAsyncContextManager:
    """One of an ActorClient's slots, held for the block (waited for while all are taken); any other client
    (a test's mock transport) has no slots to wait for."""
    return http.slots if isinstance(http, ActorClient) else contextlib.nullcontext()


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = NR_OPEN if hard == resource.RLIM_INFINITY else hard
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as err:  # e.g. fs.nr_open set below an unlimited hard limit's NR_OPEN
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, target, err)
            return soft
        return target
    return soft


def ready_process() -> None:
    """Ready the actor's process for thousands of requests in flight (the module says how): raise its open-files
    limit and the garbage collector's thresholds. `run_actor` calls it once, before the actor's client is made."""
    limit = raise_open_files_limit()
    gc.set_threshold(*GC_THRESHOLDS)
    log.info("open-files limit %d: at most %d requests in flight", limit, request_slots())


def request_slots() -> int:
    """The requests one client may have in flight: half of the process's open-files limit."""
    return max(1, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 2)


def actor_client(keepalive_s: float, max_requests: int | None = None) -> ActorClient:
    """The actor's client: no connection limit; connections idle for `keepalive_s` are dropped (client.py
    KEEPALIVE_S says why). aiohttp keeps every idle connection until then (it has no count of idle ones).
    `max_requests`: its slots (None: `request_slots()`)."""
    limits = httpx.Limits(max_connections=None, keepalive_expiry=keepalive_s)
    return ActorClient(max_requests or request_slots(), transport=Transport(limits))
