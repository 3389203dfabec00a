"""Publish, then deliver (weights/publish.py, weights/delivery.py) against tests/memory_servers.py's servers: the
real control routes, WeightUpdater and gloo receive, announced in a run directory as real servers announce
themselves. The invariant: while a version is published and no newer one comes, every announced server that
answers reaches it (a late joiner, a restart on older weights), with no further publish."""

import asyncio
import logging
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import worker_port
from memory_servers import TOKEN, HangingServer, Server, Trainer, assert_serving, metas

from pipelinerl.config import ConfigError, load_config
from pipelinerl.control import ControlClient
from pipelinerl.launch.procs import free_port
from pipelinerl.rundir import publish_server, server_file, server_roster
from pipelinerl.weights import (
    Delivery,
    DeliveryFailed,
    Publication,
    TensorMeta,
    WeightBroadcaster,
    WeightTransferError,
)
from pipelinerl.weights import delivery as delivery_module
from pipelinerl.weights.deadline import DeadlineRule, PhaseDeadline
from pipelinerl.weights.delivery import held_servers

BOUND_S = 30.0  # every wait below is on a condition, bounded by this
# A live server beside a straggler gets each version within this: ~5 s here (a 1 s floor + LATE_GRACE_S + the
# group re-formed), a margin for a loaded machine, and well below what the straggler cost before (60 s, 90 s).
STRAGGLER_BOUND_S = 30.0
REPO = Path(__file__).resolve().parent.parent


def _delivery(run_dir, publication, timeout_s: float = 4.0, deadline: DeadlineRule | None = None,
              bucket_bytes: int = 2048, **kw) -> Delivery:
    sender = WeightBroadcaster([], "gloo", "127.0.0.1", free_port(worker_port(18960)), timeout_s, bucket_bytes,
                               token=TOKEN, delta=True, deadline=deadline)
    return Delivery(publication, lambda: server_roster(run_dir), sender, ControlClient(TOKEN, 5.0), **kw).start()


def _two_announced(run_dir, weights):
    """Two servers on `weights`, announced in `run_dir`, and a delivery over them."""
    servers = [Server(weights), Server(weights)]
    for s in servers:
        publish_server(run_dir, "127.0.0.1", s.port)
    publication = Publication()
    return servers, publication, _delivery(run_dir, publication)


def _wait_until(what: str, cond, bound_s: float = BOUND_S) -> None:
    deadline = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {bound_s:.0f} s: {what}"
        time.sleep(0.05)


def _publish(publication: Publication, version: int, trainer: Trainer) -> None:
    wire = trainer.wire()
    publication.publish(version, metas(wire), (t for t in wire.values()))


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(delivery_module, "RETRY_FIRST_S", 0.2)
    monkeypatch.setattr(delivery_module, "RETRY_MAX_S", 0.5)


def test_a_server_restarted_on_older_weights_catches_up_without_a_new_version(tmp_path, fast_retries):
    trainer = Trainer()
    checkpoint = trainer.wire()
    servers, publication, d = _two_announced(tmp_path, checkpoint)
    try:
        for version in (1, 2, 3):
            trainer.step(lr=1e-5)
            _publish(publication, version, trainer)
            _wait_until(f"both servers at version {version}", lambda v=version: all(
                s.updater.version == v for s in servers))
        for s in servers:
            assert_serving(s, trainer.wire())
        servers[1].stop()  # SIGKILLed: its announcement stays until its launcher notices
        trainer.step(lr=1e-5)
        _publish(publication, 4, trainer)
        _wait_until("the live server at version 4", lambda: servers[0].updater.version == 4)
        _wait_until("the dead server backing off", lambda: d.servers[servers[1].url].failures >= 1)
        server_file(tmp_path, "127.0.0.1", servers[1].port).unlink()  # the launcher saw it die
        time.sleep(0.01)  # a distinct announcement time (ns clock) even on a coarse filesystem
        servers[1] = Server(checkpoint, port=servers[1].port)  # restarted on the checkpoint: version 0
        publish_server(tmp_path, "127.0.0.1", servers[1].port)
        # No publish from here on: the trainer waits for data that this server must generate.
        _wait_until("the restarted server at version 4", lambda: servers[1].updater.version == 4)
        for s in servers:
            assert_serving(s, trainer.wire())
        reports = d.reports()
        caught_up = [r for r in reports if r.ok and r.servers == (servers[1].url,)]
        assert caught_up and caught_up[-1].bytes == caught_up[-1].dense_bytes  # no delta base on a new server
        assert any(not r.ok for r in reports)  # the round with the dead member failed and was reported
        trainer.step(lr=1e-5)
        _publish(publication, 5, trainer)
        _wait_until("both at version 5", lambda: all(s.updater.version == 5 for s in servers))
        both = [r for r in d.reports() if r.ok and r.version == 5]
        assert both[-1].bytes < both[-1].dense_bytes  # both hold base 4 again: a delta
        for s in servers:
            assert_serving(s, trainer.wire())
        assert d.failure is None
    finally:
        d.close()
        for s in servers:
            s.stop()


def test_a_late_joiner_gets_the_published_version(tmp_path):
    trainer = Trainer()
    publication = Publication()
    trainer.step(lr=1e-5)
    _publish(publication, 7, trainer)
    d = _delivery(tmp_path, publication)
    late = Server(Trainer().wire())
    try:
        time.sleep(2 * delivery_module.POLL_S)  # nobody announced: nothing to do, nothing failed
        assert d.failure is None and not d.reports()
        assert d.wait_for(7, 0.5)  # the end of a run with no server announced: nothing to wait for
        publish_server(tmp_path, "127.0.0.1", late.port)
        _wait_until("the late joiner in the roster", lambda: late.url in d.servers)
        assert d.wait_for(7, BOUND_S)  # the end of a run: every announced server serves the last version
        assert late.updater.version == 7
        assert_serving(late, trainer.wire())
    finally:
        d.close()
        late.stop()


def test_delivery_failing_to_every_server_escalates_with_their_names(tmp_path, fast_retries):
    trainer = Trainer()
    dead_port = free_port(worker_port(18990))  # nothing listens there: a dead server whose file stayed
    publish_server(tmp_path, "127.0.0.1", dead_port)
    publication = Publication()
    d = _delivery(tmp_path, publication, fail_after_versions=2, fail_after_s=0.0)
    try:
        _publish(publication, 1, trainer)
        _wait_until("a failed attempt", lambda: d.servers.get(f"http://127.0.0.1:{dead_port}") is not None
                    and d.servers[f"http://127.0.0.1:{dead_port}"].failures >= 1)
        assert d.failure is None  # one version is not enough
        trainer.step(lr=1e-5)
        _publish(publication, 2, trainer)
        _wait_until("the escalation", lambda: d.failure is not None)
        assert isinstance(d.failure, DeliveryFailed)
        assert f"http://127.0.0.1:{dead_port}" in str(d.failure) and "trainer.delivery_fail_after" in str(d.failure)
    finally:
        d.close()


def test_one_dead_server_among_live_ones_never_escalates(tmp_path, fast_retries):
    trainer = Trainer()
    live = Server(trainer.wire())
    publish_server(tmp_path, "127.0.0.1", live.port)
    publish_server(tmp_path, "127.0.0.1", free_port(worker_port(18991)))
    publication = Publication()
    d = _delivery(tmp_path, publication, fail_after_versions=1, fail_after_s=0.0)
    try:
        for version in (1, 2, 3):
            trainer.step(lr=1e-5)
            _publish(publication, version, trainer)
            _wait_until(f"the live server at {version}", lambda v=version: live.updater.version == v)
        assert d.failure is None
        assert "failed attempt" in d.describe()  # the dead one is named in the wait logs
    finally:
        d.close()
        live.stop()


def test_a_process_whose_delivery_is_stuck_closes_and_exits_in_bounded_time(tmp_path):
    """The update hangs on the server (it never receives; weight_update_timeout_s 600): close() returns within
    its wait and the process exits at once, no thread left for the interpreter to wait on (a trainer's stop
    signal must end it inside a requeue's drain window)."""
    hung = HangingServer(Trainer().wire())
    publish_server(tmp_path, "127.0.0.1", hung.port)
    child = subprocess.Popen([sys.executable, str(Path(__file__).with_name("delivery_stuck.py")), str(tmp_path),
                              str(free_port(worker_port(18960)))], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).parent)
    try:
        _wait_until("the update under way", lambda: hung.updater.busy or child.poll() is not None, bound_s=120)
        assert hung.updater.busy, child.communicate()[0][-3000:]
        t0 = time.monotonic()
        out = child.communicate("go\n", timeout=60)[0]
        exited_s = time.monotonic() - t0
    finally:
        if child.poll() is None:
            child.kill()
        hung.release.set()
        hung.stop()
    assert child.returncode == 0, out[-3000:]
    assert float(out.rsplit("closed in ", 1)[1].split()[0]) < 6.0, out[-3000:]
    assert exited_s < 30, out[-3000:]  # close's 2 s wait, then the interpreter's exit (imports not included)
    assert hung.updater.version == 0


def test_a_held_server_is_left_alone_until_released_then_catches_up_without_a_new_version(tmp_path):
    """The evaluation servers' delivery (trainer/loop.py start_delivery(evaluation=True)): a server held for an
    evaluation (POST /hold) keeps its version while the other moves on, with no failed round and no backoff; once
    released it is brought to the newest version with no further publish."""
    trainer = Trainer()
    servers = [Server(trainer.wire()), Server(trainer.wire())]
    for s in servers:
        publish_server(tmp_path, "127.0.0.1", s.port)
    control = ControlClient(TOKEN, 5.0)
    assert control.hold(servers[1].url, 60)["version"] == 0
    publication = Publication()
    d = _delivery(tmp_path, publication, held=lambda urls: held_servers(control, urls))
    try:
        for version in (1, 2):
            trainer.step(lr=1e-5)
            _publish(publication, version, trainer)
            _wait_until(f"the free server at version {version}", lambda v=version: servers[0].updater.version == v)
        _wait_until("a round that saw the hold", lambda: servers[1].url in d.describe() and "(held)" in d.describe())
        assert servers[1].updater.version == 0 and servers[1].updater.updates == 0
        assert all(r.ok and r.servers == (servers[0].url,) for r in d.reports())
        assert d.servers[servers[1].url].failures == 0
        assert control.release(servers[1].url) == {"version": 0, "held": True}
        _wait_until("the released server at version 2", lambda: servers[1].updater.version == 2)
        for s in servers:
            assert_serving(s, trainer.wire())
        assert d.failure is None
    finally:
        d.close()
        for s in servers:
            s.stop()


def test_publishing_never_waits_for_a_delivery_and_never_overwrites_a_leased_version():
    publication = Publication()
    meta = [TensorMeta("w", "float32", [4])]
    publication.publish(1, meta, [torch.full((4,), 1.0)])
    with publication.lease() as snap:
        assert snap.version == 1
        t0 = time.monotonic()
        for v in (2, 3, 4):
            publication.publish(v, meta, [torch.full((4,), float(v))])
        assert time.monotonic() - t0 < 1.0
        assert snap.version == 1 and snap.tensors[0].tolist() == [1.0] * 4  # intact while leased
        assert publication.latest_version() == 4
    with publication.lease() as snap:
        assert snap.version == 4 and snap.tensors[0].tolist() == [4.0] * 4
    assert publication.wait_newer(4, 0.01) == 4  # nothing newer: returns at the timeout


def test_two_readers_each_keep_their_lease_intact_while_publishing_goes_on():
    """With the evaluation servers' delivery beside the training servers' (Publication(readers=2)), both may hold
    a lease, of one version or of two, and publishing still never waits and never writes a leased buffer."""
    publication = Publication(readers=2)
    meta = [TensorMeta("w", "float32", [4])]
    publication.publish(1, meta, [torch.full((4,), 1.0)])
    with publication.lease() as first, publication.lease() as same:
        assert first is same and first.leases == 2
        publication.publish(2, meta, [torch.full((4,), 2.0)])
        with publication.lease() as second:
            assert second.version == 2
            for v in (3, 4, 5):  # both older buffers are leased: the third takes every new version
                publication.publish(v, meta, [torch.full((4,), float(v))])
            assert first.tensors[0].tolist() == [1.0] * 4 and second.tensors[0].tolist() == [2.0] * 4
        assert first.leases == 2 and second.leases == 0
    with publication.lease() as snap:
        assert snap.version == 5 and snap.tensors[0].tolist() == [5.0] * 4


def test_servers_all_restarted_on_their_addresses_get_a_new_group(tmp_path):
    """Every member restarted on its old address: the same URLs are behind, but none holds the old group."""
    trainer = Trainer()
    checkpoint = trainer.wire()
    servers, publication, d = _two_announced(tmp_path, checkpoint)
    try:
        trainer.step(lr=1e-5)
        _publish(publication, 1, trainer)
        _wait_until("both at version 1", lambda: all(s.updater.version == 1 for s in servers))
        for i, s in enumerate(servers):
            s.stop()
            servers[i] = Server(checkpoint, port=s.port)
        time.sleep(0.01)  # a distinct announcement time (ns clock) even on a coarse filesystem
        for s in servers:
            publish_server(tmp_path, "127.0.0.1", s.port)
        _wait_until("both restarted servers at version 1", lambda: all(s.updater.version == 1 for s in servers))
        for s in servers:
            assert_serving(s, trainer.wire())
        assert not [r for r in d.reports() if not r.ok]  # a new group at once, not a refused update first
    finally:
        d.close()
        for s in servers:
            s.stop()


def test_the_deadline_is_the_scaled_median_times_the_factor_plus_the_margin_clamped_to_floor_and_ceiling():
    d = PhaseDeadline(DeadlineRule(factor=3.0, margin_s=2.0, floor_s=3.0, ceiling_s=20.0))
    assert d.seconds(100) == 20.0  # nothing measured yet: the ceiling
    for seconds in (1.0, 4.0, 2.0):
        d.record(seconds, 100)
    assert d.seconds(100) == 3 * 2.0 + 2  # median 2 s: 8 s
    assert d.seconds(50) == 8.0  # a smaller round keeps the measured times (mostly fixed costs)
    assert d.seconds(200) == 3 * 4.0 + 2  # twice the bytes: 2, 8, 4 s, median 4 s: 14 s
    assert d.seconds(1000) == 20.0  # 10, 40, 20 s: 62 s, clamped to the ceiling
    d.widen()  # a deadline missed with every member answering
    assert d.seconds(100) == 20.0
    d.record(2.0, 100)  # 1, 4, 2, 2 s: median 2 s, the widening is over
    assert d.seconds(100) == 8.0
    for _ in range(8):  # the median is over the last 8 only
        d.record(0.1, 100)
    assert d.seconds(100) == 3.0  # 3 x 0.1 + 2 = 2.3 s, raised to the floor
    assert PhaseDeadline(DeadlineRule()).seconds() == 120.0  # the defaults: factor 3, margin 2, floor 3, ceiling 120
    with pytest.raises(ValueError, match="floor <= ceiling"):
        DeadlineRule(floor_s=10.0, ceiling_s=5.0)
    with pytest.raises(ConfigError, match="trainer.delivery_deadline_ceiling_s"):
        load_config(REPO / "configs" / "tiny_cpu.yaml", ["trainer.delivery_deadline_ceiling_s=2"])


def test_a_server_stuck_in_an_update_is_set_aside_and_the_other_keeps_getting_versions_then_it_catches_up(
        tmp_path, fast_retries):
    """Two servers; from version 3 on, one's update never completes (it receives nothing until the test lets it:
    a server stopped mid-update). The group's timeout is 60 s, so only the round deadline (floor 1 s) can free the
    other: it reaches each version within STRAGGLER_BOUND_S; once let go, the stuck one catches up without a
    publish."""
    trainer = Trainer()
    live, stuck = Server(trainer.wire()), HangingServer(trainer.wire())
    hang = stuck.engine.receive
    del stuck.engine.receive  # a normal server until told to hang
    for s in (live, stuck):
        publish_server(tmp_path, "127.0.0.1", s.port)
    publication = Publication()
    d = _delivery(tmp_path, publication, timeout_s=60.0,
                  deadline=DeadlineRule(factor=3.0, margin_s=0.5, floor_s=1.0, ceiling_s=60.0))
    try:
        for version in (1, 2):  # measured rounds: the deadline is the floor from here on
            trainer.step(lr=1e-5)
            _publish(publication, version, trainer)
            _wait_until(f"both at version {version}", lambda v=version: all(
                s.updater.version == v for s in (live, stuck)))
        stuck.engine.receive = hang
        for version in (3, 4, 5):
            trainer.step(lr=1e-5)
            _publish(publication, version, trainer)
            _wait_until(f"the live server at version {version}", lambda v=version: live.updater.version == v,
                        bound_s=STRAGGLER_BOUND_S)
            assert_serving(live, trainer.wire())
        assert stuck.updater.version == 2 and stuck.updater.busy
        assert any("missed its deadline" in r.error and stuck.url in r.error for r in d.reports() if not r.ok)
        del stuck.engine.receive
        stuck.release.set()  # its update fails (the group was abandoned) and it answers again
        _wait_until("the stuck server at version 5", lambda: stuck.updater.version == 5)  # no publish since
        assert_serving(stuck, trainer.wire())
        assert d.failure is None
    finally:
        d.close()
        stuck.release.set()
        for s in (live, stuck):
            s.stop()


def test_the_wait_line_comes_every_period_from_the_start_while_a_round_is_stuck(tmp_path, caplog):
    """The delivery thread blocked inside a round (no deadline: the group's 60 s timeout) still logs, every
    wait_log_s from the start of the wait and once per period, the server behind and the version it is at."""
    hung = HangingServer(Trainer().wire())
    publish_server(tmp_path, "127.0.0.1", hung.port)
    publication = Publication()
    caplog.set_level(logging.WARNING, logger="pipelinerl.weights.delivery")
    d = _delivery(tmp_path, publication, timeout_s=60.0, wait_log_s=1.0)
    try:
        _publish(publication, 1, Trainer())
        _wait_until("the update under way", lambda: hung.updater.busy)

        def lines():
            return [r for r in caplog.records if "not at version 1 for" in r.getMessage()]

        _wait_until("three wait lines", lambda: len(lines()) >= 3)
        assert hung.updater.busy  # all while the round is still stuck
        found = lines()
        for r in found:
            assert f"{hung.url} at version 0" in r.getMessage(), r.getMessage()
        waited = [float(r.getMessage().split(" for ")[1].split(" s")[0]) for r in found]
        assert waited[0] >= 1.0 and waited == sorted(waited), waited
        gaps = [b.created - a.created for a, b in zip(found, found[1:])]
        assert min(gaps) > 0.5, gaps  # once per period, not a burst
    finally:
        d.close(wait_s=2.0)
        hung.release.set()
        hung.stop()


@pytest.mark.parametrize("joined", [False, True], ids=["before_joining", "after_joining"])
def test_a_server_stuck_joining_the_group_is_set_aside_and_the_other_gets_the_version(tmp_path, fast_retries,
                                                                                        joined):
    """Forming the group has its deadline too: a server announced late whose join never completes (until the test
    lets it) costs the other server one deadline, not the group's 60 s timeout. Stuck before joining the collective,
    or after it (a server stopped right after it joined: the group opens, its reply to /init_process_group never
    comes): either way a missed connect deadline, it is set aside, and once it answers again it catches up with no
    further publish."""
    trainer = Trainer()
    live, joiner = Server(trainer.wire()), Server(trainer.wire())
    publish_server(tmp_path, "127.0.0.1", live.port)
    publication = Publication()
    d = _delivery(tmp_path, publication, timeout_s=60.0,
                  deadline=DeadlineRule(factor=3.0, margin_s=0.5, floor_s=1.0, ceiling_s=60.0))
    let_go, stuck = threading.Event(), threading.Event()
    real_join = joiner.engine.join_group

    async def stuck_join(req, staging):
        if joined:
            await real_join(req, staging)
        if not let_go.is_set():
            stuck.set()
            await asyncio.to_thread(let_go.wait, 60)
        if not joined:
            await real_join(req, staging)

    joiner.engine.join_group = stuck_join
    try:
        for version in (1, 2):  # measured: forming the group and a round
            trainer.step(lr=1e-5)
            _publish(publication, version, trainer)
            _wait_until(f"the live server at version {version}", lambda v=version: live.updater.version == v)
        publish_server(tmp_path, "127.0.0.1", joiner.port)
        _wait_until("a group formed for the joiner (behind version 2), its join stuck", stuck.is_set)
        trainer.step(lr=1e-5)
        _publish(publication, 3, trainer)
        _wait_until("the live server at version 3", lambda: live.updater.version == 3, bound_s=STRAGGLER_BOUND_S)
        assert joiner.updater.busy and joiner.updater.version == 0
        late = [r.error for r in d.reports() if "connect missed its deadline" in r.error]
        assert late and joiner.url in late[0] and "still silent" in late[0], [r.error for r in d.reports()]
        let_go.set()  # its join fails or its late reply lands (that group was abandoned), and it answers again
        _wait_until("the joiner at version 3", lambda: joiner.updater.version == 3)  # no publish since
        for s in (live, joiner):
            assert_serving(s, trainer.wire())
        assert d.failure is None
    finally:
        d.close()
        let_go.set()
        for s in (live, joiner):
            s.stop()


def test_a_server_that_accepts_connections_and_never_answers_delays_no_version_of_the_others(tmp_path):
    """What a SIGSTOPped server looks like over HTTP: a socket that listens and never answers. Announced beside a
    live server, with the evaluation delivery's `held` probe and the trainer's 30 s control timeout, it is asked
    its version on a thread of its own and never probed for a hold while its version is unknown: the live server
    gets each version at once (before, each /status read of it held the delivery thread for 30 s)."""
    trainer = Trainer()
    live = Server(trainer.wire())
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # the kernel completes every connect; nothing ever reads or answers
    for port in (live.port, silent.getsockname()[1]):
        publish_server(tmp_path, "127.0.0.1", port)
    control = ControlClient(TOKEN, 30.0)
    sender = WeightBroadcaster([], "gloo", "127.0.0.1", free_port(worker_port(18960)), 60.0, bucket_bytes=2048,
                               token=TOKEN, delta=True)
    publication = Publication()
    d = Delivery(publication, lambda: server_roster(tmp_path), sender, control,
                 held=lambda urls: held_servers(control, urls)).start()
    try:
        for version in (1, 2, 3):
            trainer.step(lr=1e-5)
            _publish(publication, version, trainer)
            _wait_until(f"the live server at version {version}", lambda v=version: live.updater.version == v,
                        bound_s=20.0)  # before: 30 s per /status read of the silent one
        assert_serving(live, trainer.wire())
        assert d.servers[f"http://127.0.0.1:{silent.getsockname()[1]}"].version is None
    finally:
        d.close()
        live.stop()
        silent.close()


def test_a_slow_server_that_answers_the_abandonment_is_set_aside_when_the_other_finished_in_time(
        tmp_path, fast_retries):
    """Slow, not stopped: from version 3 on one server's receive starts 90 s late, polling the trainer's abandon
    flag meanwhile as a real receive does, so it answers the abandonment at once. Each round is one bucket (a
    delta round, or a small model's), which the other receives within the deadline: the unfinished one is set
    aside, or keeps the version if its bytes had arrived, and the live server gets each version within
    STRAGGLER_BOUND_S (before: within the slow one's 90 s); once fast again the slow one catches up without a
    publish. (In a round of many buckets the trainer paces every bucket to the slowest member, so nobody
    finishes: that round is retried with the ceiling, at the slow member's pace: deadline.py.)"""
    trainer = Trainer()
    live, slow = Server(trainer.wire()), Server(trainer.wire())
    crawling = threading.Event()
    real_receive = slow.engine.receive

    async def receive(req):
        until = time.monotonic() + 90.0
        while crawling.is_set() and time.monotonic() < until and not _abandoned(slow.engine.group):
            await asyncio.sleep(0.05)
        return await real_receive(req)  # fails at once on an abandoned group, as a real receive would

    slow.engine.receive = receive
    for s in (live, slow):
        publish_server(tmp_path, "127.0.0.1", s.port)
    publication = Publication()
    d = _delivery(tmp_path, publication, timeout_s=60.0, bucket_bytes=1 << 20,
                  deadline=DeadlineRule(factor=3.0, margin_s=0.5, floor_s=1.0, ceiling_s=60.0))
    try:
        for version in (1, 2, 3, 4, 5):
            if version == 3:
                crawling.set()
            trainer.step(lr=1e-5)
            _publish(publication, version, trainer)
            _wait_until(f"the live server at version {version}", lambda v=version: live.updater.version == v,
                        bound_s=STRAGGLER_BOUND_S)
        assert any("unfinished while" in r.error and slow.url in r.error for r in d.reports() if not r.ok)
        crawling.clear()
        _wait_until("the slow server at version 5", lambda: slow.updater.version == 5)  # no publish since
        for s in (live, slow):
            assert_serving(s, trainer.wire())
        assert d.failure is None
    finally:
        d.close()
        for s in (live, slow):
            s.stop()


def _abandoned(group) -> bool:
    try:
        group.check_abandoned()
    except WeightTransferError:
        return True
    return False
