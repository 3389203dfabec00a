"""The actor's aiohttp transport (pipelinerl/actor/transport.py) against httpx's own, on real sockets: the same
replies, and for each failure the actor tells apart (a live server's closed connection, a dead server, a silent
one) the same httpx exception class."""

import asyncio
import json

import httpx

from pipelinerl.actor.transport import actor_client

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
            ours = await _outcomes(actor_client(keepalive_s=2.0), base, f"http://127.0.0.1:{dead_port}")
            theirs = await _outcomes(httpx.AsyncClient(), base, f"http://127.0.0.1:{dead_port}")
        finally:
            server.close()
        return ours, theirs

    ours, theirs = asyncio.run(main())
    assert ours == theirs, (ours, theirs)
    assert ours["ok"] == ours["ok_again"] == {"ok": [1, 2, 3]} and ours["teapot"] == 418
    assert ours["close"] is ours["cut"] is httpx.RemoteProtocolError  # client.py retries these at once
    assert ours["dead"] is httpx.ConnectError and ours["silent"] is httpx.ReadTimeout
