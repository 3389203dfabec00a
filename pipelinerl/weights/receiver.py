"""Server side of a weight update: receive the buckets into staging (host or device memory), resolve the
deltas against the worker's base and check the checksums."""

from __future__ import annotations

import torch

from pipelinerl.dtypes import torch_dtype
from pipelinerl.weights.collective import WeightGroup, broadcast_async, wait_work
from pipelinerl.weights.delta import Delta, DeltaBase
from pipelinerl.weights.wire import UpdateRequest, plan_buckets, wire_parts


class StagingBuffers:
    """The receive buffers, kept from one update to the next: bucket k lands in buffer k. A fresh buffer costs
    a page fault per 4 KiB page on first touch, which halved gloo's receive bandwidth on CPU.

    An update's tensors are views into these buffers until loaded, so the owner hands them on only when
    nothing refers to them any more: after the load, except the buffers whose tensors the delta base kept
    (`release` those), and never after a failed collective (one that gave up may still be writing: `forget`)."""

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor] = []

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the buffers hold."""
        return sum(buf.numel() for buf in self._bufs if buf.device.type == "cpu")

    def take(self, k: int, nbytes: int, device: torch.device, pinned: bool = False) -> torch.Tensor:
        """The first `nbytes` of buffer `k` on `device` (page-locked host memory with `pinned`)."""
        while len(self._bufs) <= k:
            self._bufs.append(torch.empty(0, dtype=torch.uint8))
        buf = self._bufs[k]
        if buf.numel() < nbytes or buf.device.type != device.type or self._pinned(buf) != pinned:
            self._drop(buf)
            buf = self._bufs[k] = (self._host(nbytes, pinned) if device.type == "cpu" else
                                   torch.empty(nbytes, dtype=torch.uint8, device=device))
        return buf[:nbytes]

    def _host(self, nbytes: int, pinned: bool) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def _pinned(self, buf: torch.Tensor) -> bool:
        return buf.is_pinned()

    def _drop(self, buf: torch.Tensor) -> None:
        """A buffer leaves the set (whoever refers to it keeps it)."""

    def forget(self) -> None:
        """Let the buffers go to whoever still refers to them; the next update allocates new ones."""
        for buf in self._bufs:
            self._drop(buf)
        self._bufs = []

    def release(self, kept: list[torch.Tensor]) -> None:
        """Let go of the buffers that tensors in `kept` (the delta base's) lie in; keep the others for the next
        update. In steady delta mode the base keeps nothing new (deltas are applied to it in place), so nothing
        is allocated again."""
        held = {t.untyped_storage().data_ptr() for t in kept}
        for k, buf in enumerate(self._bufs):
            if buf.numel() and buf.untyped_storage().data_ptr() in held:
                self._drop(buf)
                self._bufs[k] = torch.empty(0, dtype=torch.uint8)


def receive_staged(group: WeightGroup, req: UpdateRequest, device: torch.device, deadline: float, peer: str,
                   staging: str = "host", base: DeltaBase | None = None,
                   buffers: StagingBuffers | None = None) -> list[tuple[str, torch.Tensor]]:
    """Server side: receive every bucket, return the update's (name, full tensor) pairs; nothing is loaded
    here, so a receive that fails part-way leaves the served model untouched (the caller drops the list).

    Each bucket lands on `device`. staging="host" copies it to host memory (pinned when `device` is a GPU,
    for the later host->device load) on a stream of its own while the next bucket lands in the other of two
    device slots (_HostCopies): two buckets of device memory, the full model of host RAM; the slowest
    server's copy no longer paces every receive. staging="device" keeps the buckets where they landed: no
    device->host->device round trip, but the full model in device memory. On CPU both are the same: the
    bucket buffers are the staging memory and the tensors are views into them (inference.update_staging).
    Deltas (delta.py) are applied to `base` once every byte has arrived; a request with deltas and no base
    fails. Every wait gives up early when the trainer abandons the group or dies (collective.py). The
    buckets land in `buffers` (new ones when None).
    """
    assert staging in ("host", "device"), staging
    receive = _Receive(group, req, device, deadline, peer, buffers if buffers is not None else StagingBuffers(),
                       _HostCopies(device) if staging == "host" and device.type != "cpu" else None)
    try:
        for k, bucket in enumerate(receive.buckets):
            receive.bucket(k, bucket)
    finally:
        if receive.copies is not None:
            receive.copies.finish()  # every bucket's bytes are in host memory before anything reads them
    sums = None
    if req.checksums:
        got = torch.empty(len(req.tensors), dtype=torch.int64, device=device)
        wait_work(broadcast_async(group, got), deadline, f"the checksum tensor from {peer}",
                  poll=group.check_abandoned)
        sums = got.cpu().tolist()
    return (base if base is not None else DeltaBase()).resolve(req, receive.staged, sums, peer)


class _Receive:
    """One update's receive, bucket by bucket: the (name, tensor or Delta) pairs staged so far."""

    def __init__(self, group: WeightGroup, req: UpdateRequest, device: torch.device, deadline: float, peer: str,
                 buffers: StagingBuffers, copies: _HostCopies | None):
        self.group, self.req, self.device, self.deadline, self.peer = group, req, device, deadline, peer
        self.buffers, self.copies = buffers, copies
        self.parts = wire_parts(req)
        self.buckets = plan_buckets(self.parts, req.bucket_bytes)
        self.staged: list[tuple[str, torch.Tensor | Delta]] = []
        self.pending: list[torch.Tensor] = []  # a delta's counts and offsets, until its values arrive

    def bucket(self, k: int, bucket) -> None:
        """Receive bucket k into buffer k, or with host copies into device slot k % 2, then host buffer 2 + k."""
        slot = k % 2 if self.copies is not None else k
        if self.copies is not None:
            self.copies.before_receive(slot)
        buf = self.buffers.take(slot, bucket.nbytes, self.device)
        if bucket.nbytes:  # a bucket of unchanged tensors' empty deltas is not sent (sender.py skips it too)
            wait_work(broadcast_async(self.group, buf), self.deadline,
                      f"bucket {k + 1}/{len(self.buckets)} from {self.peer}", poll=self.group.check_abandoned)
        if self.copies is not None:
            host = self.buffers.take(2 + k, bucket.nbytes, torch.device("cpu"), pinned=True)
            buf = self.copies.copy(slot, host, buf)
        for i, off in zip(bucket.indexes, bucket.offsets):
            part = self.parts[i]
            meta = self.req.tensors[part.tensor]
            view = buf[off:off + part.nbytes].view(torch_dtype(part.dtype))
            if part.kind == "dense":
                self.staged.append((meta.name, view.view(meta.shape)))
            elif part.kind == "values":
                self.staged.append((meta.name, Delta(*self.pending, view)))
                self.pending = []
            else:
                self.pending.append(view)


class _HostCopies:
    """Device->host copies of received buckets on a CUDA stream of their own: bucket k's copy runs while bucket
    k + 1 lands in the other device slot. A slot is received into again only after its copy is done (the
    stream that issues the receive waits for the copy's event; NCCL's stream waits for that one)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.done: list[torch.cuda.Event | None] = [None, None]

    def before_receive(self, slot: int) -> None:
        if self.done[slot] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.done[slot])

    def copy(self, slot: int, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """dst <- src (asynchronous; `finish` waits for it). dst is pinned, or pageable (then synchronous)."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # after the receive into src
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            src.record_stream(self.stream)  # the allocator keeps src's memory until the copy is done
            event = torch.cuda.Event()
            event.record(self.stream)
        self.done[slot] = event
        return dst

    def finish(self) -> None:
        self.stream.synchronize()
