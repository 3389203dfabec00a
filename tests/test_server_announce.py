"""A server's announcement (announce.py: a vLLM server's and an OpenEnv environment server's): it waits for its own
/health, writes its discovery file, retries a failed write, and a write that keeps failing is an error that stops
the server, never a healthy server left unannounced. Against a plain HTTP /health (no vLLM)."""

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pipelinerl import announce, rundir


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 -- http.server's name
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def health():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()


def test_a_failed_write_is_retried_and_then_announced(tmp_path, health, monkeypatch):
    """The first write fails (the servers folder is a file); it is fixed before the retry: announced."""
    blocker = tmp_path / rundir.SERVERS_DIR
    blocker.write_text("not a folder")
    sleeps = []

    async def sleep(s):
        sleeps.append(s)
        if s >= 1.0:  # the retry's backoff (the /health poll sleeps 0.2 s)
            blocker.unlink()

    monkeypatch.setattr(announce.asyncio, "sleep", sleep)
    published = []
    asyncio.run(announce.announce_when_healthy(str(tmp_path), "127.0.0.1", health, rundir.SERVERS_DIR, published))
    assert rundir.list_servers(tmp_path) == [f"http://127.0.0.1:{health}"] and len(published) == 1
    assert sleeps == [1.0]


def test_a_write_that_keeps_failing_raises_and_stops_the_server(tmp_path, health, monkeypatch):
    (tmp_path / rundir.SERVERS_DIR).write_text("not a folder")
    real_sleep = asyncio.sleep

    async def sleep(s):
        await real_sleep(0)  # no backoff wait, one loop turn

    monkeypatch.setattr(announce.asyncio, "sleep", sleep)
    stopped = []

    async def announcing():
        task = asyncio.ensure_future(announce.announce_when_healthy(str(tmp_path), "127.0.0.1", health,
                                                                    rundir.SERVERS_DIR, []))
        task.add_done_callback(lambda t: announce.stop_if_unannounced(t, lambda: stopped.append(True)))
        with pytest.raises(announce.AnnounceError, match=f"could not announce this server .*:{health}.* after 5 "
                                                         "attempts"):
            await task
        await asyncio.sleep(0)  # done-callbacks run on the next loop turn

    asyncio.run(announcing())
    assert stopped == [True]


def test_a_cancelled_announcement_does_not_stop_the_server():
    stopped = []

    async def cancelled():
        task = asyncio.ensure_future(asyncio.Event().wait())
        task.add_done_callback(lambda t: announce.stop_if_unannounced(t, lambda: stopped.append(True)))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled())
    assert stopped == []
