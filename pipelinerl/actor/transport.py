"""The actor's HTTP client: httpx's API (every caller, its timeouts and exceptions) over aiohttp's connection pool.

A profile of the tiny run's actor found half its CPU in httpx's own transport (httpcore): its pool re-scans every
connection and every waiting request at each request and response (`_assign_requests_to_connections`, with a
socket query per connection), which grows with the requests in flight (actor.max_groups_in_flight). aiohttp's
pool hands a free connection out in constant time. `httpx_aiohttp.AiohttpTransport` (the OpenAI SDK's aiohttp
transport) does the translation; `Transport` adds one thing: the httpx exception of each aiohttp failure is the
one httpx's own transport raises for it. The actor tells a connection a live server closed under a request
(RemoteProtocolError, ReadError, WriteError: retried at once, client.py `_dropped_by_live`) from a dead server
(ConnectError) and a timeout, and httpx_aiohttp maps every aiohttp connection error to ConnectTimeout.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport


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


def actor_client(keepalive_s: float) -> httpx.AsyncClient:
    """The actor's client: no connection limit; connections idle for `keepalive_s` are dropped (client.py
    KEEPALIVE_S says why). aiohttp keeps every idle connection until then (it has no count of idle ones)."""
    limits = httpx.Limits(max_connections=None, keepalive_expiry=keepalive_s)
    return httpx.AsyncClient(transport=Transport(limits))
