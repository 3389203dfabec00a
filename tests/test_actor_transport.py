"""The actor's aiohttp transport (pipelinerl/actor/transport.py) against httpx's own, on real sockets: the same
replies, and for each failure the actor tells apart (a live server's closed connection, a dead server, a silent
one) the same httpx exception class. Then what thousands of requests in flight need of the process: its
open-files limit raised, and a request slot for each request."""

import asyncio
import json
import resource
import subprocess
import sys
import textwrap

import httpx
from test_actor import _announce, _choice, _config, _status

from pipelinerl.actor.client import CompletionsClient
from pipelinerl.actor.transport import GC_THRESHOLDS, NR_OPEN, ActorClient, actor_client, raise_open_files_limit

REPLY = json.dumps({"ok": [1, 2, 3]}).encode()


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """GET /ok: a JSON reply (keep-alive); /teapot: 418; /close: the connection closed with no reply; /cut: a
    reply whose body stops short; /silent: no reply within the test's timeout."""
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        path = head.split(b" ", 2)[1]
        if path == b"/close":
            writer.close()
            return
        if path == b"/silent":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:  # the test's server closing
                pass
            return
        status, body = (b"418 I'm a teapot", b"{}") if path == b"/teapot" else (b"200 OK", REPLY)
        length = len(body) + 100 if path == b"/cut" else len(body)
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(length).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        if path == b"/cut":
            writer.close()
            return


async def _outcomes(client: httpx.AsyncClient, base: str, dead: str) -> dict:
    """Per case: the reply's JSON or status, or the exception class raised."""
    out = {}
    cases = {"ok": f"{base}/ok", "ok_again": f"{base}/ok", "teapot": f"{base}/teapot", "close": f"{base}/close",
             "cut": f"{base}/cut", "silent": f"{base}/silent", "dead": f"{dead}/ok"}
    async with client:
        for name, url in cases.items():
            try:
                resp = await client.get(url, timeout=1.0)
                out[name] = resp.json() if resp.status_code == 200 else resp.status_code
            except httpx.HTTPError as err:
                out[name] = type(err)
    return out


def test_the_aiohttp_transport_answers_and_fails_like_httpx_own():
    async def main():
        server = await asyncio.start_server(_handle, "127.0.0.1", 0)
        dead = await asyncio.start_server(_handle, "127.0.0.1", 0)
        dead_port = dead.sockets[0].getsockname()[1]
        dead.close()
        await dead.wait_closed()  # nothing listens there any more: connection refused
        base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            ours = await _outcomes(actor_client(keepalive_s=2.0, max_requests=16), base, f"http://127.0.0.1:{dead_port}")
            theirs = await _outcomes(httpx.AsyncClient(), base, f"http://127.0.0.1:{dead_port}")
        finally:
            server.close()
        return ours, theirs

    ours, theirs = asyncio.run(main())
    assert ours == theirs, (ours, theirs)
    assert ours["ok"] == ours["ok_again"] == {"ok": [1, 2, 3]} and ours["teapot"] == 418
    assert ours["close"] is ours["cut"] is httpx.RemoteProtocolError  # client.py retries these at once
    assert ours["dead"] is httpx.ConnectError and ours["silent"] is httpx.ReadTimeout


def test_the_actor_process_raises_the_open_files_limit_and_its_client_gives_half_to_requests():
    """A process started under a soft limit of 64 open files (the usual default is 1,024, too few for thousands of
    requests in flight): the actor's process setup raises it to the hard limit and the collector's thresholds,
    and the actor's client lets half of it be requests in flight."""
    script = textwrap.dedent("""
        import gc, json, resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        from pipelinerl.actor.transport import actor_client, ready_process
        ready_process()
        http = actor_client(keepalive_s=2.0)
        print(json.dumps({"hard": hard, "limit": resource.getrlimit(resource.RLIMIT_NOFILE),
                          "max_requests": http.max_requests, "gc": gc.get_threshold()}))
    """)
    out = json.loads(subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                                    text=True).stdout)
    hard = NR_OPEN if out["hard"] == resource.RLIM_INFINITY else out["hard"]
    assert out["limit"] == [hard, out["hard"]] and out["max_requests"] == hard // 2
    assert tuple(out["gc"]) == GC_THRESHOLDS


def test_an_unlimited_hard_limit_raises_the_soft_one_to_nr_open(monkeypatch):
    calls = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, resource.RLIM_INFINITY))
    monkeypatch.setattr(resource, "setrlimit", lambda _, limits: calls.append(limits))
    assert raise_open_files_limit() == NR_OPEN and calls == [(NR_OPEN, resource.RLIM_INFINITY)]

    def refused(_, limits):
        raise ValueError("not allowed")

    monkeypatch.setattr(resource, "setrlimit", refused)  # fs.nr_open below NR_OPEN: the limit stays
    assert raise_open_files_limit() == 1024


def test_requests_beyond_the_clients_slots_wait_for_one_before_taking_a_server(tmp_path):
    """10 completions on a client of 3 slots, against a server that holds every request until the test lets them
    go: 3 reach the server (and count in its load), 7 wait for a slot; once released, all 10 complete, never more
    than 3 at once on the server."""
    _announce(tmp_path, 1)
    cfg = _config(tmp_path, tmp_path / "unused", tmp_path / "actor.yaml", "actor.max_lag=null")
    client = CompletionsClient(cfg.actor, str(tmp_path), reference=False)
    held, most, gate = [], [0], asyncio.Event()

    async def server(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/status":
            return httpx.Response(200, json=_status(0))
        held.append(request)
        most[0] = max(most[0], len(held))
        await gate.wait()
        held.remove(request)
        return httpx.Response(200, json={"choices": [_choice(0, "1", 2, True)]})

    async def main() -> int:
        async with ActorClient(3, transport=httpx.MockTransport(server)) as http:
            requests = [asyncio.ensure_future(client.complete(http, [1, 2], greedy=True)) for _ in range(10)]
            for _ in range(3000):  # at most 30 s
                if len(held) == 3 and http.slots.locked():
                    break
                await asyncio.sleep(0.01)
            load = sum(client.pool.load.values())
            gate.set()
            await asyncio.wait_for(asyncio.gather(*requests), 30)
            return load

    assert asyncio.run(main()) == 3
    assert most[0] == 3 and not held
