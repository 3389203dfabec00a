"""A tensor-parallel server's staging (weights/shared.py): received once, shared through files, with real processes.

The receiving worker is this process (a gloo member of a weight-update group whose trainer is a thread); the
other tensor-parallel worker is a second process that maps the files. vLLM's part (handing the refs over its
tensor-parallel group, every worker's load) runs in tests/test_inference_tp.py on a real TP=2 server.
"""

import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import helpers
import pytest
import torch
from test_weights import _trainer_send

from pipelinerl.weights import InitRequest, TensorMeta, UpdateRequest, WeightTransferError, open_group, receive_staged
from pipelinerl.weights.shared import PREFIX, SharedBuffers, SharedViews, StagedRef, describe, remove_stale

METAS = [TensorMeta("a", "float32", [64, 33]), TensorMeta("b", "bfloat16", [70]), TensorMeta("c", "int64", [5])]
BUCKET_BYTES = 4096  # a's 8448 bytes alone; b and c together: two buckets


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 33, generator=g), torch.randn(70, generator=g).bfloat16(),
            torch.randint(0, 1000, (5,), generator=g)]


def _receive(port: int, tensors, buffers: SharedBuffers, version: int, bucket_bytes: int = BUCKET_BYTES,
             timeout_s: float = 10.0):
    """One update from a trainer thread into `buffers`, as the receiving worker does it."""
    req = UpdateRequest(version, bucket_bytes, METAS, checksums=True)
    sender = threading.Thread(target=_trainer_send, args=(port, tensors, req))
    sender.start()
    try:
        group = open_group(InitRequest("127.0.0.1", port, 1, 2, "gloo", timeout_s), 1)
        return receive_staged(group, req, torch.device("cpu"), time.monotonic() + timeout_s, "trainer",
                              buffers=buffers)
    finally:
        sender.join()


def _other_worker(conn) -> None:
    """The other tensor-parallel worker: for each list of refs received, attach them and send back the tensors
    (copies, compared by the test) and whether each lies in its own mapping of the receiving worker's file."""
    views = SharedViews()
    while (refs := conn.recv()) is not None:
        staged = views.attach(refs)
        conn.send([(name, t.clone(), t.untyped_storage().filename) for name, t in staged])


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob(f"{PREFIX}{os.getpid()}-*"))


def test_one_copy_is_received_and_the_other_worker_loads_the_same_bytes(tmp_path):
    """Two updates: the second reuses the first's files, which no longer have names by then, so the other
    worker must read them through the mappings it kept. Only the receiving worker's buffers hold memory: the
    other worker allocates none (its tensors lie in its mappings of the same files)."""
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    other = ctx.Process(target=_other_worker, args=(child_conn,), daemon=True)
    other.start()
    buffers, paths = SharedBuffers(str(tmp_path)), []
    try:
        for version in (1, 2):
            tensors = _tensors(version)
            staged = _receive(helpers.worker_port(18560) + version, tensors, buffers, version)
            refs = describe(staged)
            assert _files(tmp_path) == ([] if version == 2 else sorted(Path(p).name for p in buffers.named))
            conn.send(refs)
            got = conn.recv()
            buffers.handed_over({ref.path for ref in refs})
            assert _files(tmp_path) == []  # every name removed once the other worker mapped the files
            for (name, t, path), ref, want in zip(got, refs, tensors):
                assert name == ref.name and path == ref.path and torch.equal(t, want)
            paths.append(sorted({ref.path for ref in refs}))
            # 8448 + (140 bf16 bytes, aligned to 192, + 40 int64 bytes): the update's bytes, once
            assert buffers.host_bytes == 8448 + 192 + 40
        assert paths[0] == paths[1] and len(paths[0]) == 2  # bucket k stays in file k
    finally:
        conn.send(None)
        other.join(timeout=60)


def test_a_broken_broadcast_leaves_no_file_and_the_next_update_new_ones(tmp_path):
    buffers = SharedBuffers(str(tmp_path))
    req = UpdateRequest(1, BUCKET_BYTES, METAS)
    # the trainer joins and sends nothing: the first bucket never comes
    trainer = threading.Thread(target=lambda: open_group(InitRequest("127.0.0.1", port, 1, 2, "gloo", 2.0), 0))
    port = helpers.worker_port(18566)
    trainer.start()
    group = open_group(InitRequest("127.0.0.1", port, 1, 2, "gloo", 2.0), 1)
    with pytest.raises((TimeoutError, WeightTransferError)):
        receive_staged(group, req, torch.device("cpu"), time.monotonic() + 2.0, "trainer", buffers=buffers)
    trainer.join()
    assert len(buffers.named) == 1  # bucket 1's file was made before the wait
    buffers.discard_new()  # the worker engine does this on any failed receive
    assert _files(tmp_path) == [] and buffers.host_bytes == 0


def test_a_full_tmpfs_fails_with_a_message_not_a_sigbus(tmp_path, monkeypatch):
    """posix_fallocate reserves the pages when the file is made; a full /dev/shm is simulated (filling the real
    one would take the machine's memory)."""
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    buffers = SharedBuffers(str(tmp_path))
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="must hold one copy of the model per server"):
        buffers.take(0, 1 << 20, torch.device("cpu"))
    assert _files(tmp_path) == [] and buffers.named == []


def test_files_of_dead_receivers_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale, live = tmp_path / f"{PREFIX}{dead.stdout.strip()}-0", tmp_path / f"{PREFIX}{os.getpid()}-99"
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    assert remove_stale(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists()


def test_refs_name_the_file_offset_and_shape_of_every_tensor(tmp_path):
    buffers = SharedBuffers(str(tmp_path))
    buf = buffers.take(0, 256, torch.device("cpu"))
    staged = [("x", buf[64:64 + 24].view(torch.float32).view(2, 3)), ("y", buf[128:130].view(torch.bfloat16))]
    path = buffers.named[0]
    assert describe(staged) == [StagedRef("x", path, 256, 64, "float32", [2, 3]),
                                StagedRef("y", path, 256, 128, "bfloat16", [1])]
    buffers.handed_over(set())  # nobody maps it: the name goes and the buffer is dropped
    assert buffers.host_bytes == 0 and _files(tmp_path) == []
    with pytest.raises(AssertionError, match="shared staging file"):
        describe([("z", torch.zeros(3))])


@pytest.mark.parametrize(("tp", "pp", "expected"), [(1, 1, [5]), (4, 1, [5, None, None, None]),
                                                     (2, 2, [5, None, 6, None])])
def test_one_group_member_per_tensor_parallel_group(tp, pp, expected):
    """vLLM orders worker ranks [pipeline stage, tensor-parallel rank]: the group ranks of a server whose
    rank_offset is 5."""
    from pipelinerl.inference.vllm_glue.transfer import group_members, group_rank

    pcs = [SimpleNamespace(rank=r, world_size=tp * pp, tensor_parallel_size=tp, data_parallel_index=0)
           for r in range(tp * pp)]
    assert [group_rank(pc, 5) for pc in pcs] == expected
    assert group_members(pcs[0]) == pp
