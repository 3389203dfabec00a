"""Delta weight updates (weights/delta.py) and the weight-update group's re-forming, end to end without
vLLM: the real WeightBroadcaster, the real control routes and WeightUpdater (inference/server.py,
updates.py) over HTTP, and a memory engine that receives with the real receive_staged over gloo and loads
by keeping copies of the tensors.

The "training" is an fp32 master copy moved by Adam-sized steps (|step| = lr) and cast to bfloat16 for
the wire, as DeepSpeed's bf16 mode does; references are bit-wise comparisons of integer views.
"""

import asyncio
import threading
import time

import pytest
import torch
import uvicorn
from fastapi import FastAPI
from helpers import worker_port
from prometheus_client import CollectorRegistry

from pipelinerl.inference.rundir import server_file
from pipelinerl.inference.server import control_router
from pipelinerl.inference.updates import WeightUpdater
from pipelinerl.launch.procs import free_port
from pipelinerl.weights import (
    Delta,
    DeltaBase,
    DeltaEncoder,
    TensorMeta,
    UpdateRejected,
    UpdateRequest,
    WeightBroadcaster,
    WeightTransferError,
    changed_positions,
    open_group,
    parse_update_request,
    receive_staged,
    wire_parts,
)
from pipelinerl.weights import sender as sender_module
from pipelinerl.weights.delta import encode_positions

TOKEN = "t" * 32
TIMEOUT_S = 4.0  # the group's collectives: a broken broadcast fails on the servers within this


class MemoryEngine:
    """An UpdatableEngine whose model is a dict of tensors; receive as vllm_glue/transfer.py does."""

    num_ranks = 1

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = {n: t.clone() for n, t in weights.items()}
        self.group = self.req = self.staged = None
        self.base = DeltaBase()

    async def set_version(self, version: int) -> None:
        pass

    async def join_group(self, req, staging: str) -> None:
        self.req = req
        self.group = await asyncio.to_thread(open_group, req, req.rank_offset)

    async def pause(self, recompute: bool) -> None:
        pass

    async def receive(self, req: UpdateRequest) -> None:
        try:
            self.staged = await asyncio.to_thread(receive_staged, self.group, req, torch.device("cpu"),
                                                  time.monotonic() + self.req.timeout_s, "the trainer", "host",
                                                  self.base)
        except UpdateRejected:
            raise
        except BaseException:
            self.base.drop()
            self.group = None
            raise

    async def load(self, version: int) -> None:
        self.weights.update((n, t.clone()) for n, t in self.staged)

    async def resume(self) -> None:
        pass

    async def worker_timings(self) -> list[dict[str, float]]:
        return [{}]

    async def in_group(self) -> bool:
        return self.group is not None


class Server:
    def __init__(self, weights: dict[str, torch.Tensor], port: int | None = None):
        self.engine = MemoryEngine(weights)
        self.updater = WeightUpdater(self.engine, {n: list(t.shape) for n, t in weights.items()}, "bfloat16",
                                     "keep", 0, registry=CollectorRegistry())
        app = FastAPI()
        app.include_router(control_router(self.updater, TOKEN))
        self.port = port or free_port(worker_port(18900))
        self.uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uv.started:
            assert time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout=10)


class Trainer:
    """An fp32 master copy, bf16 on the wire: most elements change in no step at lr 1e-5."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.g = g
        self.master = {"embed": torch.randn(64, 32, generator=g) * 0.05, "w1": torch.randn(48, 32, generator=g) * 0.05,
                       "bias": torch.zeros(48), "frozen": torch.randn(16, generator=g)}

    def step(self, lr: float) -> None:
        for name, m in self.master.items():
            if name == "frozen":
                continue
            big = 10.0 if name == "bias" else 1.0  # the bias moves a lot: sent dense, per tensor
            m -= lr * big * torch.sign(torch.randn(m.shape, generator=self.g))

    def wire(self) -> dict[str, torch.Tensor]:
        return {n: m.bfloat16() for n, m in self.master.items()}


def _metas(weights: dict[str, torch.Tensor]) -> list[TensorMeta]:
    return [TensorMeta(n, "bfloat16", list(t.shape)) for n, t in weights.items()]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _assert_serving(server: Server, weights: dict[str, torch.Tensor]) -> None:
    for name, want in weights.items():
        assert torch.equal(_bits(server.engine.weights[name]), _bits(want)), name


@pytest.fixture
def two_servers():
    trainer = Trainer()
    servers = [Server(trainer.wire()), Server(trainer.wire())]
    yield trainer, servers
    for s in servers:
        s.stop()


def _broadcaster(servers, **kw) -> WeightBroadcaster:
    b = WeightBroadcaster([s.url for s in servers], "gloo", "127.0.0.1", free_port(worker_port(18950)), TIMEOUT_S,
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
            metas = _metas(wire)
            out = b.broadcast(version, metas, list(wire.values()))
            for s in servers:
                _assert_serving(s, wire)
                assert s.updater.version == version and s.updater.delta_base == version
            dense = sum(m.nbytes for m in metas)
            if version == 1:  # nothing to diff against yet
                assert out["bytes"] == dense and out["delta_tensors"] == 0
                prev = wire
                continue
            # the hand count: changed elements of the tensors sent as deltas (all but the bias)
            changed = {n: int((_bits(wire[n]) != _bits(prev[n])).sum()) for n in wire}
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
            out = b.broadcast(version, _metas(wire), list(wire.values()))
            for s in servers:
                _assert_serving(s, wire)
        assert out.get("resent_dense") == 1 and out["bytes"] == sum(m.nbytes for m in _metas(wire))
        assert all(s.updater.delta_base == 2 for s in servers)
    finally:
        b.close()


def test_a_broken_delta_broadcast_leaves_the_old_weights_and_the_next_update_is_dense(two_servers, monkeypatch):
    trainer, servers = two_servers
    b = _broadcaster(servers)
    try:
        for version in (1, 2):
            trainer.step(lr=1e-5)
            b.broadcast(version, _metas(trainer.wire()), list(trainer.wire().values()))
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
            b.broadcast(3, _metas(trainer.wire()), list(trainer.wire().values()))
        monkeypatch.setattr(sender_module, "broadcast_async", real)
        deadline = time.monotonic() + 10 * TIMEOUT_S
        while any(s.updater.busy or s.updater.group_ready for s in servers):  # each times out on its own
            assert time.monotonic() < deadline, "a server never gave up on the broken broadcast"
            time.sleep(0.05)
        for s in servers:
            _assert_serving(s, served)
            assert s.updater.version == 2 and s.updater.delta_base is None
        b.connect()
        out = b.broadcast(3, _metas(trainer.wire()), list(trainer.wire().values()))
        assert out["bytes"] == sum(m.nbytes for m in _metas(trainer.wire()))  # dense: no server has a base
        for s in servers:
            _assert_serving(s, trainer.wire())
    finally:
        b.close()


def test_a_server_without_the_base_gets_a_dense_update(two_servers):
    trainer, servers = two_servers
    b = _broadcaster(servers)
    try:
        for version in (1, 2):
            trainer.step(lr=1e-5)
            b.broadcast(version, _metas(trainer.wire()), list(trainer.wire().values()))
        b._bases[servers[1].url] = None  # as connect() reads a restarted server's /status
        trainer.step(lr=1e-5)
        out = b.broadcast(3, _metas(trainer.wire()), list(trainer.wire().values()))
        assert out["bytes"] == sum(m.nbytes for m in _metas(trainer.wire()))
        for s in servers:
            _assert_serving(s, trainer.wire())
            assert s.updater.delta_base == 3
    finally:
        b.close()


def test_a_delta_against_another_base_is_refused_before_any_byte():
    trainer = Trainer()
    server = Server(trainer.wire())
    try:
        import httpx

        body = {"version": 5, "bucket_bytes": 2048, "base_version": 4, "nnz": [0, 0, 0, 0],
                "tensors": [{"name": m.name, "dtype": m.dtype, "shape": m.shape} for m in _metas(trainer.wire())]}
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


# Servers that come and go: trainer.broadcast.ServerBroadcaster over the same memory servers, announced in a
# run directory as real servers announce themselves.

def _run_broadcaster(tmp_path, servers):
    from pipelinerl.config import load_config
    from pipelinerl.inference.rundir import publish_server
    from pipelinerl.trainer.broadcast import ServerBroadcaster
    from pipelinerl.trainer.dist import DistInfo

    for s in servers:
        publish_server(tmp_path, "127.0.0.1", s.port)
    cfg = load_config(None, [f"run_dir={tmp_path}", f"model.path={tmp_path}", f"inference.auth_token={TOKEN}",
                             "model.dtype=bfloat16",
                             "inference.weight_update_backend=gloo",
                             f"trainer.broadcast_port={free_port(worker_port(18970))}",
                             f"inference.weight_update_timeout_s={TIMEOUT_S * 5}", "trainer.broadcast_delta=auto",
                             "trainer.broadcast_bucket_mb=0.002"])
    b = ServerBroadcaster(cfg, DistInfo(0, 1, 0, "gloo"))
    assert b.connect()
    return b


def _restart(old: Server, weights: dict[str, torch.Tensor], run_dir) -> Server:
    """A new server on the old one's port, from older weights (a restart from a checkpoint), announced."""
    from pipelinerl.inference.rundir import publish_server

    old.stop()
    new = Server(weights, port=old.port)
    time.sleep(0.01)  # a distinct announcement time (ns clock) even on coarse filesystems
    publish_server(run_dir, "127.0.0.1", new.port)
    return new


def test_a_dead_server_is_left_out_and_its_restart_joins_at_the_next_update(tmp_path):
    trainer = Trainer()
    checkpoint = trainer.wire()
    servers = [Server(checkpoint), Server(checkpoint)]
    b = _run_broadcaster(tmp_path, servers)
    try:
        trainer.step(lr=1e-5)
        assert "failed" not in b.broadcast(1, _metas(trainer.wire()), list(trainer.wire().values()))
        servers[1].stop()  # dies between updates; its announcement stays, as after a SIGKILL
        trainer.step(lr=1e-5)
        failed = b.broadcast(2, _metas(trainer.wire()), iter(list(trainer.wire().values())))
        assert failed["failed"] == 1.0
        retry = b.broadcast(2, _metas(trainer.wire()), list(trainer.wire().values()))  # the loop's retry
        assert "failed" not in retry and list(retry["servers"]) == [servers[0].url]
        _assert_serving(servers[0], trainer.wire())
        server_file(tmp_path, "127.0.0.1", servers[1].port).unlink()  # the launcher saw it die
        formed = b._sender._groups
        trainer.step(lr=1e-5)
        assert "failed" not in b.broadcast(3, _metas(trainer.wire()), list(trainer.wire().values()))
        assert b._sender._groups == formed  # a left-out server's announcement gone: no group re-formed
        servers[1] = _restart(servers[1], checkpoint, tmp_path)
        trainer.step(lr=1e-5)
        out = b.broadcast(4, _metas(trainer.wire()), list(trainer.wire().values()))
        assert sorted(out["servers"]) == sorted(s.url for s in servers)
        assert out["bytes"] == sum(m.nbytes for m in _metas(trainer.wire()))  # dense: the new one has no base
        for s in servers:
            _assert_serving(s, trainer.wire())
            assert s.updater.version == 4
    finally:
        b.close()
        for s in servers:
            s.stop()


def test_a_restarted_trainer_is_accepted_at_once():
    """A trainer dies between updates (nothing abandons its group): the servers still hold that group, and
    a new trainer's group replaces it without waiting for any timeout."""
    trainer = Trainer()
    servers = [Server(trainer.wire()), Server(trainer.wire())]
    try:
        first = _broadcaster(servers)
        trainer.step(lr=1e-5)
        first.broadcast(1, _metas(trainer.wire()), list(trainer.wire().values()))
        assert all(s.updater.group_ready for s in servers)
        t0 = time.monotonic()
        second = _broadcaster(servers)  # no close() of the first: it "died"
        assert time.monotonic() - t0 < TIMEOUT_S
        trainer.step(lr=1e-5)
        out = second.broadcast(2, _metas(trainer.wire()), list(trainer.wire().values()))
        assert out["bytes"] == sum(m.nbytes for m in _metas(trainer.wire()))  # a new trainer starts dense
        for s in servers:
            _assert_serving(s, trainer.wire())
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
        with pytest.raises(WeightTransferError, match="fell off the bus"):
            b.connect()
        t0 = time.monotonic()
        assert b.connect([good.url]) == [good.url]
        assert time.monotonic() - t0 < timeout_s / 2
        trainer.step(lr=1e-5)
        assert "failed" not in b.broadcast(1, _metas(trainer.wire()), list(trainer.wire().values()))
        _assert_serving(good, trainer.wire())
    finally:
        b.close()
        good.stop()
        bad.stop()
