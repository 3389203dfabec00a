"""Waits say what is current, once per period (issue 43, item 8).

The actor: many requests that no server of a pool may take share one wait line per actor.wait_log_s (a stall
used to log one line per waiting request in the same milliseconds), driven here by a clock the test moves, so
the count is exact whatever the load. The trainer: its wait line reads every server's version when it logs
(delivery's record lags a round stuck on one member) and names the stopped server the newest version has not
reached.
"""

import asyncio
import collections
import logging
import re
import signal
import socket
import subprocess
import sys
import time
import types

import httpx
import pytest
from memory_servers import TOKEN, Server, Trainer, metas
from test_actor import _announce, _config, _status

from pipelinerl.actor import client as client_module
from pipelinerl.actor.client import CompletionsClient
from pipelinerl.config import load_config
from pipelinerl.control import ControlClient
from pipelinerl.launch.procs import free_port
from pipelinerl.trainer import step_data as step_data_module
from pipelinerl.trainer.dist import DistInfo
from pipelinerl.trainer.step_data import StepData, StreamStarved
from pipelinerl.weights import Delivery, Publication, WeightBroadcaster
from pipelinerl.weights.delivery import ServerState

WAITERS, EVERY_S = 8, 30.0
BOUND_S = 30.0  # every wait on a condition below


class _Clock:
    """The actor client's time.monotonic(), moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


async def _until(what: str, cond) -> None:
    deadline = time.monotonic() + BOUND_S
    while not cond():
        assert time.monotonic() < deadline, f"not within {BOUND_S:.0f} s: {what}"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("kind", ["policy", "reward"])
def test_many_waiting_requests_log_one_line_per_period_with_the_pool_as_it_is_then(tmp_path, monkeypatch, caplog,
                                                                                   kind):
    """8 requests that no server may take (policy: h:1 reports version 4, they need 5; reward: none announced). The
    clock moves by actor.wait_log_s, by half of it, and by it again, and every waiter looks at least once after
    each move: exactly one line per period, naming how many wait, the oldest's wait, and the pool as it is when the
    line is logged (a policy server announced meanwhile is in the next line). Fewer waiters: the count follows."""
    clock = _Clock()
    monkeypatch.setattr(client_module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    monkeypatch.setattr(client_module, "ACQUIRE_EVERY_S", 0.001, raising=False)
    _announce(tmp_path, *([1] if kind == "policy" else []))
    cfg = _config(tmp_path, tmp_path / "unused", tmp_path / "actor.yaml", f"actor.wait_log_s={EVERY_S}")
    client = CompletionsClient(cfg.actor, str(tmp_path), reference=False, max_lag=2, reward=True)
    pool = client.pool if kind == "policy" else client.reward_pool
    need = 5 if kind == "policy" else None
    looks: collections.Counter = collections.Counter()  # waiting request -> its pool.acquire calls
    acquire = pool.acquire

    def counted(*args, **kwargs):
        looks[asyncio.current_task()] += 1
        return acquire(*args, **kwargs)

    pool.acquire = counted

    async def status(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=_status(4 if request.url.host == "h" and request.url.port == 1 else 3))

    def lines() -> list[str]:  # every warning: the wait lines are the only ones here
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    async def all_look_again(waiters) -> None:
        # 3 acquire calls after the move: a policy request calls it twice per look, so one look came after it
        seen = {w: looks[w] for w in waiters}
        await _until("every waiter looks again", lambda: all(looks[w] >= seen[w] + 3 for w in waiters))

    async def waits() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(status)) as http:
            waiters = [asyncio.create_task(client._acquire(http, pool, set(), need)) for _ in range(WAITERS)]
            await all_look_again(waiters)
            assert lines() == []
            clock.now += EVERY_S
            await all_look_again(waiters)
            assert len(lines()) == 1
            if kind == "policy":
                _announce(tmp_path, 2)  # reports version 3: the next line names it
            clock.now += EVERY_S / 2
            await all_look_again(waiters)
            assert len(lines()) == 1
            clock.now += EVERY_S / 2
            await all_look_again(waiters)
            assert len(lines()) == 2
            for w in waiters[:5]:
                w.cancel()
            await asyncio.gather(*waiters[:5], return_exceptions=True)
            clock.now += EVERY_S
            await all_look_again(waiters[5:])
            assert len(lines()) == 3
            for w in waiters[5:]:
                w.cancel()
            await asyncio.gather(*waiters[5:], return_exceptions=True)

    with caplog.at_level(logging.WARNING, logger="pipelinerl.actor"):
        asyncio.run(asyncio.wait_for(waits(), timeout=2 * BOUND_S))
    first, second, third = lines()
    if kind == "policy":
        pool_now = (r"it needs version >= 5 and within max_lag=2 of the newest version reported \(4\); announced: "
                    r"http://h:1 at version 4")
        assert re.fullmatch(rf"8 request\(s\) wait for a policy server, the oldest for 30 s: {pool_now}", first)
        assert re.fullmatch(rf"8 request\(s\) wait for a policy server, the oldest for 60 s: {pool_now}, "
                            r"http://h:2 at version 3", second)
    else:
        assert first == ("8 request(s) wait for a reward server, the oldest for 30 s: it needs any server; "
                         "announced: none")
        assert second.startswith("8 request(s) wait for a reward server, the oldest for 60 s")
    assert third.startswith(f"3 request(s) wait for a {kind} server, the oldest for 90 s")


def _stopped_server() -> tuple[subprocess.Popen, str]:
    """A real HTTP server, SIGSTOPped: connections are accepted by the kernel and no request is ever answered."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + BOUND_S
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None, "the server to stop never listened"
            time.sleep(0.05)
    proc.send_signal(signal.SIGSTOP)
    return proc, f"http://127.0.0.1:{port}"


def test_the_trainers_wait_line_reads_versions_now_and_names_the_stuck_server(tmp_path, monkeypatch, caplog):
    """A round of version 2 stuck on a stopped member: the healthy server serves 2, while delivery's record still
    has both at 1 (a record changes when its round ends). Rank 0 waits for data that never comes: its wait line
    gives the healthy server at version 2 (read then) and names the stopped one, at 1, as stuck behind version 2
    with that version's age. The /status reads get 10 s: the healthy one answers well within it on a loaded machine,
    the stopped one never does."""
    monkeypatch.setattr(step_data_module, "STATUS_TIMEOUT_S", 10.0, raising=False)
    trainer = Trainer()
    healthy = Server(trainer.wire())
    healthy.updater.version = 2  # it loaded version 2 from the stuck round
    stopped, stopped_url = _stopped_server()
    publication = Publication()
    wire = trainer.wire()
    publication.publish(2, metas(wire), list(wire.values()))
    sender = WeightBroadcaster([], "gloo", "127.0.0.1", free_port(), 4.0, bucket_bytes=2048, token=TOKEN)
    delivery = Delivery(publication, lambda: {}, sender, ControlClient(TOKEN, 5.0))  # not started: a given state
    delivery.servers = {u: ServerState(u, announced_at=1, version=1) for u in (healthy.url, stopped_url)}
    cfg = load_config(None, [f"run_dir={tmp_path}", "model.path=unused", "actor.attempts=4",
                             "trainer.samples_per_step=4", "trainer.wait_log_s=0.01", "trainer.data_timeout_s=1",
                             "streams.poll_interval_s=0.05"])
    data = StepData(cfg, DistInfo(0, 1, 0, "gloo"), None, lambda: False, delivery)
    try:
        with caplog.at_level(logging.WARNING, logger="pipelinerl.trainer.step_data"), pytest.raises(StreamStarved):
            data.next_step(3)  # the line is due before the deadline is looked at: at least one, by construction
    finally:
        stopped.kill()
        stopped.wait()
        healthy.stop()
    line = next(r.getMessage() for r in caplog.records if "has waited" in r.getMessage())
    assert f"{healthy.url} at version 2;" in line, line
    assert re.search(r"weight delivery: version 2 published \d+ s ago; ", line), line
    assert re.search(rf"{stopped_url} at version 1 \(no answer to GET /status within 10 s: delivery's last record\), "
                     r"stuck: version 2, published \d+ s ago, has not reached it", line), line
