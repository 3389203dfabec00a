"""The weight-update wire format and the trainer/receiver pair over real gloo, without vLLM."""

import gc
import os
import threading
import time
from datetime import timedelta

import helpers
import pytest
import torch

from pipelinerl.rundir import list_servers, publish_server, run_token
from pipelinerl.weights import (
    ALIGN_BYTES,
    InitRequest,
    StagingBuffers,
    TensorMeta,
    UpdateRequest,
    WeightTransferError,
    broadcast_async,
    open_group,
    parse_init_request,
    parse_update_request,
    plan_buckets,
    receive_staged,
    tensor_checksum,
    wait_work,
)


def _metas() -> list[TensorMeta]:
    return [TensorMeta("a", "float32", [3, 5]), TensorMeta("b", "bfloat16", [7]),
            TensorMeta("c", "float32", [40]), TensorMeta("d", "int64", [])]


def test_plan_buckets_is_in_order_aligned_and_bounded():
    metas = _metas()
    buckets = plan_buckets(metas, bucket_bytes=160)
    assert [i for b in buckets for i in b.indexes] == [0, 1, 2, 3]
    for b in buckets:
        assert all(off % ALIGN_BYTES == 0 for off in b.offsets)
        ends = [off + metas[i].nbytes for i, off in zip(b.indexes, b.offsets)]
        assert b.nbytes == max(ends) and (b.nbytes <= 160 or len(b.indexes) == 1)
        assert all(e <= o for e, o in zip(ends, b.offsets[1:]))  # no overlap
    assert len(plan_buckets(metas, bucket_bytes=1 << 20)) == 1


def test_parse_requests_reject_bad_bodies_with_clear_messages():
    with pytest.raises(ValueError, match="backend"):
        parse_init_request({"master_addr": "h", "master_port": 1, "rank_offset": 1, "world_size": 2,
                            "backend": "mpi", "timeout_s": 1})
    with pytest.raises(ValueError, match="rank_offset"):
        parse_init_request({"master_addr": "h", "master_port": 1, "rank_offset": 0, "world_size": 2,
                            "backend": "gloo", "timeout_s": 1})
    ok = {"version": 3, "bucket_bytes": 64, "tensors": [{"name": "a", "dtype": "float32", "shape": [2]}]}
    assert parse_update_request(ok).tensors == [TensorMeta("a", "float32", [2])]
    for bad, match in ((["x"], "object"), ({**ok, "version": "3"}, "version"),
                       ({**ok, "tensors": ok["tensors"] * 2}, "unique"),
                       ({**ok, "tensors": [{"name": "a", "dtype": "complex64", "shape": [2]}]}, "dtype"),
                       ({**ok, "tensors": [{"name": "a", "dtype": "float32", "shape": [-1]}]}, "shape")):
        with pytest.raises(ValueError, match=match):
            parse_update_request(bad)


def _trainer_send(port: int, tensors: list[torch.Tensor], req: UpdateRequest, corrupt: bool = False) -> None:
    group = open_group(InitRequest("127.0.0.1", port, 1, 2, "gloo", 10.0), 0)
    for bucket in plan_buckets(req.tensors, req.bucket_bytes):
        buf = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        for i, off in zip(bucket.indexes, bucket.offsets):
            t = tensors[i]
            buf[off:off + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
        wait_work(broadcast_async(group, buf), time.monotonic() + 10, "the receiver")
    sums = [tensor_checksum(t) + int(corrupt) for t in tensors]
    wait_work(broadcast_async(group, torch.tensor(sums)), time.monotonic() + 10, "the receiver")


@pytest.mark.parametrize("corrupt", [False, True])
def test_receive_staged_round_trips_and_checks_checksums(corrupt):
    port = helpers.worker_port(18520) + int(corrupt)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=g), torch.randn(7, generator=g).bfloat16(),
               torch.randn(40, generator=g), torch.tensor(12345)]
    req = UpdateRequest(1, 160, _metas(), checksums=True)
    sender = threading.Thread(target=_trainer_send, args=(port, tensors, req, corrupt))
    sender.start()
    group = open_group(InitRequest("127.0.0.1", port, 1, 2, "gloo", 10.0), 1)
    if corrupt:
        with pytest.raises(WeightTransferError, match="checksum mismatch"):
            receive_staged(group, req, torch.device("cpu"), time.monotonic() + 10, "trainer")
    else:
        staged = receive_staged(group, req, torch.device("cpu"), time.monotonic() + 10, "trainer")
        assert [n for n, _ in staged] == ["a", "b", "c", "d"]
        for (_, got), want in zip(staged, tensors):
            assert got.dtype == want.dtype and torch.equal(got, want)
    sender.join()


def test_receive_reuses_its_buffers_until_forgotten():
    """Two updates through one StagingBuffers land in the same memory, each with its own values; forgotten
    buffers stay with whoever holds the tensors and the next update gets new ones."""
    buffers, g, staged = StagingBuffers(), torch.Generator().manual_seed(1), []
    for version in (1, 2):
        port = helpers.worker_port(18540) + version
        tensors = [torch.randn(3, 5, generator=g), torch.randn(7, generator=g).bfloat16(),
                   torch.randn(40, generator=g), torch.tensor(version)]
        req = UpdateRequest(version, 160, _metas(), checksums=True)
        sender = threading.Thread(target=_trainer_send, args=(port, tensors, req))
        sender.start()
        group = open_group(InitRequest("127.0.0.1", port, 1, 2, "gloo", 10.0), 1)
        staged.append(receive_staged(group, req, torch.device("cpu"), time.monotonic() + 10, "trainer",
                                     buffers=buffers))
        sender.join()
        assert all(torch.equal(got, want) for (_, got), want in zip(staged[-1], tensors))
    ptrs = [s[0][1].untyped_storage().data_ptr() for s in staged]
    assert ptrs[0] == ptrs[1]
    buffers.forget()  # staged[1] still holds the old buffers: new memory, necessarily
    assert buffers.take(0, 160, torch.device("cpu")).untyped_storage().data_ptr() != ptrs[1]


def _gloo_thread_cores() -> dict[int, frozenset[int]]:
    """This process's gloo threads (its TCP loops and workers): thread id -> the cores it may run on."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if "gloo" in f.read():
                    out[int(tid)] = frozenset(os.sched_getaffinity(int(tid)))
        except (FileNotFoundError, ProcessLookupError):  # a thread (of any library) that ended since the listing
            pass
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_gloo_threads_take_the_cores_they_are_given_not_the_callers():
    """Both ranks open the group from a thread bound to one core (as a vLLM CPU worker's main thread is);
    rank 1 passes every core: its gloo threads may use them all, rank 0's keep the caller's one core."""
    cores, port, before, groups = sorted(os.sched_getaffinity(0)), helpers.worker_port(18545), _gloo_thread_cores(), []

    def open_rank(rank: int, cpus) -> None:
        os.sched_setaffinity(0, cores[:1])  # this thread only
        groups.append(open_group(InitRequest("127.0.0.1", port, 1, 2, "gloo", 10.0), rank, cpus=cpus))

    threads = [threading.Thread(target=open_rank, args=(0, None)), threading.Thread(target=open_rank, args=(1, cores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    new = {tid: c for tid, c in _gloo_thread_cores().items() if tid not in before}
    assert len(groups) == 2 and set(new.values()) == {frozenset(cores[:1]), frozenset(cores)}


def test_packing_copies_the_bytes_of_every_dtype_and_layout():
    """The trainer's bucket copy (single-threaded on the host) against torch's own copy."""
    from pipelinerl.weights.sender import _copy_into

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(64, 33, generator=g), torch.randn(5, 9, generator=g).t(),
               torch.randn(7, generator=g).bfloat16(), torch.tensor(12345), torch.randn(3, requires_grad=True)]
    buf = torch.zeros(9000, dtype=torch.uint8)
    offsets = [0, 8448, 8704, 8768, 8832]  # ALIGN_BYTES apart, as plan_buckets places them
    for off, t in zip(offsets, tensors):
        _copy_into(buf[off:off + t.nbytes], t)
    for off, t in zip(offsets, tensors):
        assert torch.equal(buf[off:off + t.nbytes].view(t.dtype).view(t.shape), t.detach())


def _joined_pair(port: int) -> tuple[list, object]:
    """Rank 0's group (kept alive in the returned list) and rank 1's."""
    held = []
    opener = threading.Thread(target=lambda: held.append(open_group(InitRequest("127.0.0.1", port, 1, 2, "gloo", 5.0),
                                                                    0)))
    opener.start()
    group = open_group(InitRequest("127.0.0.1", port, 1, 2, "gloo", 5.0), 1)
    opener.join()
    return held, group


def test_receive_times_out_naming_the_peer():
    trainer = helpers.worker_port(18530)
    held, group = _joined_pair(trainer)
    req = UpdateRequest(1, 1 << 10, _metas())
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=f"trainer at 127.0.0.1:{trainer}"):
        receive_staged(group, req, torch.device("cpu"), time.monotonic() + 1.0, f"the trainer at 127.0.0.1:{trainer}")
    assert time.monotonic() - t0 < 6.0 and held


@pytest.mark.parametrize("how", ["abandoned", "died"])
def test_receive_gives_up_at_once_when_the_trainer_abandons_the_group_or_dies(how):
    """The deadline is far; the receiver leaves within a few polls of the abort flag or of the store's loss."""
    port = helpers.worker_port(18531) + (how == "died")
    held, group = _joined_pair(port)
    if how == "abandoned":
        held[0].abandon("a server died")
    else:
        held.clear()  # rank 0's group and store gone, as with a dead trainer process
        gc.collect()
    t0 = time.monotonic()
    # a dead trainer: its store is gone, or gloo's sockets to it closed first
    match = "abandoned weight-update group weights: a server died" if how == "abandoned" else \
        "lost the store|Connection closed by peer"
    with pytest.raises(WeightTransferError, match=match):
        receive_staged(group, UpdateRequest(1, 1 << 10, _metas()), torch.device("cpu"), time.monotonic() + 60,
                       "the trainer")
    assert time.monotonic() - t0 < 10.0


def test_run_token_is_private_and_shared(tmp_path):
    token = run_token(tmp_path)
    assert (tmp_path / "auth_token").stat().st_mode & 0o777 == 0o600 and len(token) >= 32
    assert run_token(tmp_path) == token and run_token(None, "x" * 20) == "x" * 20
    (tmp_path / "auth_token").chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        run_token(tmp_path)


def test_discovery_files(tmp_path):
    path = publish_server(tmp_path, "node1", 8080)
    assert list_servers(tmp_path) == ["http://node1:8080"]
    path.unlink()
    assert list_servers(tmp_path) == []


def test_a_member_that_joined_and_died_fails_the_others_in_the_rendezvous_bound(monkeypatch):
    """World of 3: ranks 0 and 1 open the group; rank 2 says `joined` (a server whose /init_process_group was
    then cut short by its death) and never connects. Both fail within RENDEZVOUS_S (2 s here), far below the
    group's 600 s collective timeout, naming the group."""
    from pipelinerl.weights import collective

    monkeypatch.setattr(collective, "RENDEZVOUS_S", 2.0)
    port = helpers.worker_port(18533)
    req = InitRequest("127.0.0.1", port, 1, 3, "gloo", 600.0)
    errors: dict[int, BaseException] = {}

    def join(rank: int) -> None:
        try:
            open_group(req, rank)
        except BaseException as err:  # noqa: BLE001 -- collected for the assertions
            errors[rank] = err

    t0 = time.monotonic()
    opener = threading.Thread(target=join, args=(0,))
    opener.start()
    deadline = time.monotonic() + 30
    while True:  # rank 0 hosts the store: connect once it is up
        try:
            store = torch.distributed.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=5))
            break
        except RuntimeError:
            assert time.monotonic() < deadline, "rank 0's store never came up"
            time.sleep(0.05)
    torch.distributed.PrefixStore("weights/", store).set("joined/2", "1")
    join(1)
    opener.join(timeout=60)
    assert not opener.is_alive() and time.monotonic() - t0 < 20.0
    for rank in (0, 1):
        assert isinstance(errors.get(rank), WeightTransferError), errors
        assert "not every member connected within 2 s" in str(errors[rank])


def test_a_stalled_communicator_setup_fails_within_the_bound_and_an_abandon_stops_it_sooner(monkeypatch):
    """The communicator's construction and first connection (NCCL's blocking init, here an injected stall at
    the same call site on gloo) run under the rendezvous bound: with every member's setup stalled, rank 0 and
    a member fail within RENDEZVOUS_S (2 s) naming the group, not after the 600 s collective timeout; a
    member whose trainer abandons the group meanwhile gives up at its next abandon poll; the stalled setup
    threads never block the caller."""
    from pipelinerl.weights import collective

    release = threading.Event()
    monkeypatch.setattr(collective, "RENDEZVOUS_S", 2.0)
    monkeypatch.setattr(collective, "_communicator", lambda *a, **k: release.wait(120))
    errors: dict[int, tuple[BaseException, float]] = {}

    def join(req, rank: int) -> None:
        t0 = time.monotonic()
        try:
            open_group(req, rank)
        except BaseException as err:  # noqa: BLE001 -- collected for the assertions
            errors[rank] = (err, time.monotonic() - t0)

    try:
        port = helpers.worker_port(18541)
        req = InitRequest("127.0.0.1", port, 1, 2, "gloo", 600.0)
        threads = [threading.Thread(target=join, args=(req, r)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        for rank in (0, 1):
            err, took = errors[rank]
            assert isinstance(err, WeightTransferError), errors
            assert "weight-update group weights at 127.0.0.1" in str(err) and "within 2 s" in str(err)
            assert 2.0 <= took < 20.0

        errors.clear()
        monkeypatch.setattr(collective, "RENDEZVOUS_S", 300.0)
        store = torch.distributed.TCPStore("127.0.0.1", helpers.worker_port(18542), None, True,
                                           timedelta(seconds=30), wait_for_workers=False)
        req = InitRequest("127.0.0.1", store.port, 1, 2, "gloo", 600.0)
        prefixed = torch.distributed.PrefixStore("weights/", store)
        prefixed.set("go", "1")  # rank 0 saw every member; its own setup is the stalled one
        member = threading.Thread(target=join, args=(req, 1))
        member.start()
        deadline = time.monotonic() + 30
        while not prefixed.check(["joined/1"]):  # the member is in its setup once it said joined
            assert time.monotonic() < deadline
            time.sleep(0.02)
        collective.abandon_open(store, "weights", "a server failed")
        member.join(timeout=60)
        err, took = errors[1]
        assert isinstance(err, WeightTransferError) and "abandoned weight-update group weights" in str(err)
        assert "a server failed" in str(err) and took < 60.0
    finally:
        release.set()
