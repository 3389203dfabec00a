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
    nothing refers to them any more: after the load, unless the delta base keeps the tensors (`forget` then),
    and never after a failed collective (one that gave up may still be writing: `forget`)."""

    can_pin = True  # host buffers may be page-locked (shared.SharedBuffers' may not)

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor] = []

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the buffers hold."""
        return sum(buf.numel() for buf in self._bufs if buf.device.type == "cpu")

    def take(self, k: int, nbytes: int, device: torch.device, pinned: bool = False) -> torch.Tensor:
        """The first `nbytes` of buffer `k` on `device` (page-locked host memory with `pinned`, where it can be)."""
        pinned = pinned and self.can_pin
        while len(self._bufs) <= k:
            self._bufs.append(torch.empty(0, dtype=torch.uint8))
        buf = self._bufs[k]
        if buf.numel() < nbytes or buf.device.type != device.type or buf.is_pinned() != pinned:
            buf = self._bufs[k] = (self._host(nbytes, pinned) if device.type == "cpu" else
                                   torch.empty(nbytes, dtype=torch.uint8, device=device))
        return buf[:nbytes]

    def _host(self, nbytes: int, pinned: bool) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def forget(self) -> None:
        """Let the buffers go to whoever still refers to them; the next update allocates new ones."""
        self._bufs = []


def receive_staged(group: WeightGroup, req: UpdateRequest, device: torch.device, deadline: float, peer: str,
                   staging: str = "host", base: DeltaBase | None = None,
                   buffers: StagingBuffers | None = None) -> list[tuple[str, torch.Tensor]]:
    """Server side: receive every bucket, return the update's (name, full tensor) pairs; nothing is loaded
    here, so a receive that fails part-way leaves the served model untouched (the caller drops the list).

    Each bucket lands on `device`. staging="host" copies it to host memory before the next bucket (pinned
    when `device` is a GPU and `buffers` can pin, for the later host->device load): one bucket of device
    memory, the full model of host RAM. staging="device" keeps the buckets where they landed: no
    device->host->device round trip, but the full model in device memory. On CPU both are the same: the
    bucket buffers are the staging memory and the tensors are views into them (inference.update_staging).
    Deltas (delta.py) are applied to `base` once every byte has arrived; a request with deltas and no base
    fails. Every wait gives up early when the trainer abandons the group or dies (collective.py). The
    buckets land in `buffers` (new ones when None).
    """
    assert staging in ("host", "device"), staging
    staged: list[tuple[str, torch.Tensor | Delta]] = []
    parts = wire_parts(req)
    buckets = plan_buckets(parts, req.bucket_bytes)
    pending: list[torch.Tensor] = []  # a delta's counts and offsets, until its values arrive
    buffers = buffers if buffers is not None else StagingBuffers()
    to_host = staging == "host" and device.type != "cpu"  # one device buffer, then bucket k in pinned 1 + k
    for k, bucket in enumerate(buckets):
        buf = buffers.take(0 if to_host else k, bucket.nbytes, device)
        if bucket.nbytes:  # a bucket of unchanged tensors' empty deltas is not sent (sender.py skips it too)
            wait_work(broadcast_async(group, buf), deadline, f"bucket {k + 1}/{len(buckets)} from {peer}",
                      poll=group.check_abandoned)
        if to_host:
            buf = buffers.take(1 + k, bucket.nbytes, torch.device("cpu"), pinned=True).copy_(buf)
        for i, off in zip(bucket.indexes, bucket.offsets):
            part = parts[i]
            meta = req.tensors[part.tensor]
            view = buf[off:off + part.nbytes].view(torch_dtype(part.dtype))
            if part.kind == "dense":
                staged.append((meta.name, view.view(meta.shape)))
            elif part.kind == "values":
                staged.append((meta.name, Delta(*pending, view)))
                pending = []
            else:
                pending.append(view)
    sums = None
    if req.checksums:
        got = torch.empty(len(req.tensors), dtype=torch.int64, device=device)
        wait_work(broadcast_async(group, got), deadline, f"the checksum tensor from {peer}",
                  poll=group.check_abandoned)
        sums = got.cpu().tolist()
    return (base if base is not None else DeltaBase()).resolve(req, staged, sums, peer)
