"""Delta weight updates (weights/delta.py) and the weight-update group's re-forming, end to end without
vLLM: the real WeightBroadcaster against tests/memory_servers.py's servers (the real control routes and
WeightUpdater over HTTP, a memory engine receiving with the real receive_staged over gloo)."""

import time

import pytest
import torch
from helpers import worker_port
from memory_servers import TIMEOUT_S, TOKEN, MemoryEngine, Server, Trainer, assert_serving, bits
from memory_servers import metas as wire_metas

from pipelinerl.control import ControlError
from pipelinerl.launch.procs import free_port
from pipelinerl.weights import (
    Delta,
    DeltaEncoder,
    WeightBroadcaster,
    changed_positions,
    parse_update_request,
    wire_parts,
)
from pipelinerl.weights import sender as sender_module
from pipelinerl.weights.delta import encode_positions


@pytest.fixture
def two_servers():
    trainer = Trainer()
    servers = [Server(trainer.wire()), Server(trainer.wire())]
    yield trainer, servers
    for s in servers:
        s.stop()


def _broadcaster(servers, timeout_s: float = TIMEOUT_S, **kw) -> WeightBroadcaster:
    b = WeightBroadcaster([s.url for s in servers], "gloo", "127.0.0.1", free_port(worker_port(18950)), timeout_s,
                          bucket_bytes=2048, token=TOKEN, delta=True, **kw)
    b.connect()
    return b


def test_twenty_delta_updates_are_bit_exact_on_two_servers(two_servers):
    trainer, servers = two_servers
    b = _broadcaster(servers, checksum_every=5)
    try:
        prev = trainer.wire()
        for version in range(1, 21):
            trainer.step(lr=1e-5)
            wire = trainer.wire()
            metas = wire_metas(wire)
            out = b.broadcast(version, metas, list(wire.values()))
            for s in servers:
                assert_serving(s, wire)
                assert s.updater.version == version and s.updater.delta_base == version
            # the staging buffers kept for the next update hold nothing the base still views (the dense bias)
            engine = servers[0].engine
            live = {buf.untyped_storage().data_ptr() for buf in engine.buffers._bufs if buf.numel()}
            assert not live & {t.untyped_storage().data_ptr() for t in engine.base.tensors.values()}
            dense = sum(m.nbytes for m in metas)
            if version == 1:  # nothing to diff against yet
                assert out["bytes"] == dense and out["delta_tensors"] == 0
                prev = wire
                continue
            # the hand count: changed elements of the tensors sent as deltas (all but the bias)
            changed = {n: int((bits(wire[n]) != bits(prev[n])).sum()) for n in wire}
            assert out["changed_fraction"] == sum(changed.values()) / sum(t.numel() for t in wire.values())
            assert changed["frozen"] == 0 and changed["bias"] > 0.5 * wire["bias"].numel()
            assert out["delta_tensors"] == 3  # embed, w1, frozen (0 elements); the bias goes dense
            # a delta: one int32 count per block of 65536 elements, 2 bytes of offset and 2 of value per change
            expected = sum(4 + k * (2 + 2) for n, k in changed.items() if n != "bias") + wire["bias"].numel() * 2
            assert out["bytes"] == expected and out["bytes"] < 0.5 * dense
            prev = wire
    finally:
        b.close()


def test_a_rejected_delta_is_resent_dense(two_servers, monkeypatch):
    """A delta corrupted on the wire (the base keeps the right values) fails the servers' checksum: both
    reject it keeping their group, and the trainer resends the version dense at once."""
    trainer, servers = two_servers
    b = _broadcaster(servers, checksum_every=1)
    real = DeltaEncoder.encode

    def corrupt(self, meta, t, delta):
        piece, k = real(self, meta, t, delta)
        if meta.name == "w1" and hasattr(piece, "values") and piece.values.numel():
            piece.values = piece.values.clone()
            piece.values[0] += 1.0
        return piece, k

    try:
        for version in (1, 2):
            trainer.step(lr=1e-5)
            wire = trainer.wire()
            monkeypatch.setattr(DeltaEncoder, "encode", corrupt if version == 2 else real)
            out = b.broadcast(version, wire_metas(wire), list(wire.values()))
            for s in servers:
                assert_serving(s, wire)
        assert out.get("resent_dense") == 1 and out["bytes"] == sum(m.nbytes for m in wire_metas(wire))
        assert all(s.updater.delta_base == 2 for s in servers)
    finally:
        b.close()


def test_a_broken_delta_broadcast_leaves_the_old_weights_and_the_next_update_is_dense(two_servers, monkeypatch):
    trainer, servers = two_servers
    b = _broadcaster(servers)
    try:
        for version in (1, 2):
            trainer.step(lr=1e-5)
            b.broadcast(version, wire_metas(trainer.wire()), list(trainer.wire().values()))
        served = trainer.wire()
        trainer.step(lr=1e-5)
        real, calls = sender_module.broadcast_async, []

        def dies_after_one_bucket(group, tensor):
            calls.append(1)
            if len(calls) > 1:
                raise RuntimeError("trainer killed mid-broadcast")
            return real(group, tensor)

        monkeypatch.setattr(sender_module, "broadcast_async", dies_after_one_bucket)
        with pytest.raises(RuntimeError, match="killed"):
            b.broadcast(3, wire_metas(trainer.wire()), list(trainer.wire().values()))
        monkeypatch.setattr(sender_module, "broadcast_async", real)
        deadline = time.monotonic() + 10 * TIMEOUT_S
        while any(s.updater.busy or s.updater.group_ready for s in servers):  # each times out on its own
            assert time.monotonic() < deadline, "a server never gave up on the broken broadcast"
            time.sleep(0.05)
        for s in servers:
            assert_serving(s, served)
            assert s.updater.version == 2 and s.updater.delta_base is None
        b.connect()
        out = b.broadcast(3, wire_metas(trainer.wire()), list(trainer.wire().values()))
        assert out["bytes"] == sum(m.nbytes for m in wire_metas(trainer.wire()))  # dense: no server has a base
        for s in servers:
            assert_serving(s, trainer.wire())
    finally:
        b.close()


def test_a_server_without_the_base_gets_a_dense_update(two_servers):
    trainer, servers = two_servers
    b = _broadcaster(servers)
    try:
        for version in (1, 2):
            trainer.step(lr=1e-5)
            b.broadcast(version, wire_metas(trainer.wire()), list(trainer.wire().values()))
        b._bases[servers[1].url] = None  # as connect() reads a restarted server's /status
        trainer.step(lr=1e-5)
        out = b.broadcast(3, wire_metas(trainer.wire()), list(trainer.wire().values()))
        assert out["bytes"] == sum(m.nbytes for m in wire_metas(trainer.wire()))
        for s in servers:
            assert_serving(s, trainer.wire())
            assert s.updater.delta_base == 3
    finally:
        b.close()


def test_a_delta_against_another_base_is_refused_before_any_byte():
    trainer = Trainer()
    server = Server(trainer.wire())
    try:
        import httpx

        body = {"version": 5, "bucket_bytes": 2048, "base_version": 4, "nnz": [0, 0, 0, 0],
                "tensors": [{"name": m.name, "dtype": m.dtype, "shape": m.shape} for m in wire_metas(trainer.wire())]}
        resp = httpx.post(server.url + "/request_weight_update", json=body,
                          headers={"Authorization": f"Bearer {TOKEN}"})
        assert resp.status_code == 412 and "delta base is None" in resp.json()["error"]
    finally:
        server.stop()


def test_delta_requests_are_validated():
    ok = {"version": 3, "bucket_bytes": 64, "tensors": [{"name": "a", "dtype": "bfloat16", "shape": [2, 3]}]}
    req = parse_update_request({**ok, "base_version": 2, "nnz": [4], "keep_base": True})
    assert [(p.kind, p.dtype, p.numel) for p in wire_parts(req)] == [("counts", "int32", 1), ("offsets", "int16", 4),
                                                                      ("values", "bfloat16", 4)]
    for bad, match in (({**ok, "base_version": 2}, "together"), ({**ok, "nnz": [1]}, "together"),
                       ({**ok, "base_version": 2, "nnz": [7]}, "nnz"),
                       ({**ok, "base_version": 2, "nnz": [1, 1]}, "one"),
                       ({**ok, "keep_base": 1}, "keep_base")):
        with pytest.raises(ValueError, match=match):
            parse_update_request(bad)


def test_positions_round_trip_through_blocks():
    numel = 3 * 65536 + 17
    positions = torch.tensor([0, 5, 32767, 32768, 65535, 65536, 2 * 65536 + 40000, 3 * 65536 + 16])
    counts, offsets = encode_positions(positions, numel)
    assert counts.tolist() == [5, 1, 1, 1] and offsets.dtype == torch.int16
    assert torch.equal(Delta(counts, offsets, torch.zeros(8)).positions(), positions)


def test_changed_positions_is_bitwise():
    old = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=torch.bfloat16)
    new = torch.tensor([-0.0, 1.0, float("nan"), 2.015625], dtype=torch.bfloat16)
    assert changed_positions(old, new).tolist() == [0, 3]  # -0.0 != 0.0 bit-wise; the same NaN is unchanged


def test_a_restarted_trainer_is_accepted_at_once():
    """A trainer dies between updates (nothing abandons its group): the servers still hold that group, and
    a new trainer's group replaces it without waiting for any timeout."""
    trainer = Trainer()
    servers = [Server(trainer.wire()), Server(trainer.wire())]
    timeout_s = 60.0  # the groups' timeout, which waiting for the old group would take: far above the connect time
    try:
        first = _broadcaster(servers, timeout_s)
        trainer.step(lr=1e-5)
        first.broadcast(1, wire_metas(trainer.wire()), list(trainer.wire().values()))
        assert all(s.updater.group_ready for s in servers)
        t0 = time.monotonic()
        second = _broadcaster(servers, timeout_s)  # no close() of the first: it "died"
        assert time.monotonic() - t0 < timeout_s / 2
        trainer.step(lr=1e-5)
        out = second.broadcast(2, wire_metas(trainer.wire()), list(trainer.wire().values()))
        assert out["bytes"] == sum(m.nbytes for m in wire_metas(trainer.wire()))  # a new trainer starts dense
        for s in servers:
            assert_serving(s, trainer.wire())
        second.close()
    finally:
        for s in servers:
            s.stop()


class BrokenJoinEngine(MemoryEngine):
    """A server that fails to join (a driver error) after it answered /status."""

    async def join_group(self, req, staging: str) -> None:
        raise RuntimeError("the device fell off the bus")


def test_a_member_failing_to_join_does_not_hold_up_the_next_group():
    """Server B fails its join while server A waits inside the open: the trainer gives that attempt up and
    flags it, A leaves it at once (not after the group's timeout), and the next group, opened on the same
    store, forms without waiting for the abandoned rendezvous (which used to hold rank 0's one store
    connection until its timeout)."""
    trainer = Trainer()
    good, bad = Server(trainer.wire()), Server(trainer.wire())
    bad.engine.__class__ = BrokenJoinEngine
    timeout_s = 60.0  # the abandoned rendezvous would block for this long
    b = WeightBroadcaster([good.url, bad.url], "gloo", "127.0.0.1", free_port(worker_port(18950)), timeout_s,
                          bucket_bytes=2048, token=TOKEN)
    try:
        with pytest.raises(ControlError, match="fell off the bus"):
            b.connect()
        t0 = time.monotonic()
        assert b.connect([good.url]) == [good.url]
        assert time.monotonic() - t0 < timeout_s / 2
        trainer.step(lr=1e-5)
        assert "failed" not in b.broadcast(1, wire_metas(trainer.wire()), list(trainer.wire().values()))
        assert_serving(good, trainer.wire())
    finally:
        b.close()
        good.stop()
        bad.stop()


def test_staging_buffers_release_only_what_the_base_views():
    """release(kept): the buffers that kept tensors lie in are let go (the next update allocates anew there);
    the others are handed out again, same memory, on the next take."""
    from pipelinerl.weights.receiver import StagingBuffers

    bufs = StagingBuffers()
    cpu = torch.device("cpu")
    first = [bufs.take(k, 1000, cpu) for k in range(3)]
    first[1].zero_()
    kept = [first[1][100:300].view(torch.int16)]  # a base tensor viewing buffer 1
    bufs.release(kept)
    again = [bufs.take(k, 1000, cpu) for k in range(3)]
    ptr = [b.untyped_storage().data_ptr() for b in first], [b.untyped_storage().data_ptr() for b in again]
    assert ptr[0][0] == ptr[1][0] and ptr[0][2] == ptr[1][2] and ptr[0][1] != ptr[1][1]
    again[1].fill_(7)
    assert not (kept[0] == 0x0707).any()  # the kept view is untouched by the buffer that replaced it
