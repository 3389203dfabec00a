"""Published weight versions: the trainer's side of "publish, then deliver" (rank 0, host memory).

The training loop's job ends at `Publication.publish`: the gathered weights of a version are copied into host
memory and the loop goes on; weights/delivery.py takes the newest version from there to the servers, on its
own thread, whenever a server is behind. One snapshot buffer per reader plus one: each delivery (the training
servers', and the evaluation servers' when inference.eval_servers > 0) leases the newest one while it sends, and
`publish` writes into a buffer no one leases, so publishing never waits for a delivery and a delivery never
reads a buffer that is being written. A version published while the previous one is still being delivered
replaces the older unsent one: servers want the newest weights, not every version.

Host memory: readers + 1 copies of the LM's weights on rank 0's node (a 7B model in bf16: 2 x 15 GB, 3 x 15 GB
with evaluation servers), plus each delivery's delta base in delta mode (trainer.broadcast_delta). On GPU the
buffers are pinned, so the device-to-host copy and the delivery's host-to-device bucket packing run at full
PCIe speed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from pipelinerl.weights.wire import TensorMeta


@dataclass
class Snapshot:
    """One buffer: the weights of `version` (None while empty or being written), in `metas` order."""

    version: int | None = None
    metas: list[TensorMeta] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    published_at: float = 0.0  # time.monotonic() of the publish
    leases: int = 0  # readers sending it now


@dataclass(frozen=True)
class PublishStats:
    version: int
    bytes: int
    copy_s: float  # wall time of the copy into host memory (the gather's time included: it feeds the copy)


class Publication:
    """The newest published version, for `readers` readers (delivery threads, each holding at most one lease at
    a time) and one writer (the loop)."""

    def __init__(self, readers: int = 1) -> None:
        self._cond = threading.Condition()
        self._buffers = [Snapshot() for _ in range(readers + 1)]
        self._latest: Snapshot | None = None

    def publish(self, version: int, metas: list[TensorMeta], tensors: Iterable[torch.Tensor]) -> PublishStats:
        """Copy `tensors` (in `metas` order, each valid only until the next is drawn: a ZeRO-3 gather) as
        `version`. Never waits for a delivery: it writes the buffer delivery does not hold."""
        started = time.monotonic()
        with self._cond:
            buf = next(b for b in sorted(self._buffers, key=lambda b: b is self._latest) if not b.leases)
            if buf is self._latest:  # the others are being delivered: this one's unsent version is replaced
                self._latest = None
            buf.version = None
        nbytes = _copy_tensors(buf, metas, tensors)
        with self._cond:
            buf.version, buf.metas, buf.published_at = version, list(metas), time.monotonic()
            self._latest = buf
            self._cond.notify_all()
        return PublishStats(version, nbytes, time.monotonic() - started)

    def latest_version(self) -> int | None:
        with self._cond:
            return self._latest.version if self._latest is not None else None

    def wait_newer(self, than: int | None, timeout_s: float) -> int | None:
        """Wait up to `timeout_s` for a version other than `than`; the newest version (None: none yet)."""
        with self._cond:
            self._cond.wait_for(lambda: self._latest is not None and self._latest.version != than, timeout_s)
            return self._latest.version if self._latest is not None else None

    def wake(self) -> None:
        """Wake a `wait_newer` (the delivery thread, when it is told to stop)."""
        with self._cond:
            self._cond.notify_all()

    @contextlib.contextmanager
    def lease(self) -> Iterator[Snapshot | None]:
        """The newest snapshot, kept intact until the block ends (None when nothing was published yet)."""
        with self._cond:
            snap = self._latest
            if snap is not None:
                snap.leases += 1
        try:
            yield snap
        finally:
            if snap is not None:
                with self._cond:
                    snap.leases -= 1


def _copy_tensors(buf: Snapshot, metas: list[TensorMeta], tensors: Iterable[torch.Tensor]) -> int:
    """Copy each tensor into `buf`'s host tensor of its name (allocated once, reused by later versions)."""
    old = {m.name: t for m, t in zip(buf.metas, buf.tensors)}
    out, nbytes, it, cuda = [], 0, iter(tensors), False
    for meta in metas:
        src = next(it, None)
        if src is None:
            raise ValueError(f"the tensors iterable ended before {meta.name!r}")
        dst = old.get(meta.name)
        if dst is None or dst.shape != src.shape or dst.dtype != src.dtype:
            dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
        dst.copy_(src.detach(), non_blocking=src.is_cuda)  # stream-ordered: safe against a ZeRO-3 re-partition
        cuda |= src.is_cuda
        out.append(dst)
        nbytes += dst.numel() * dst.element_size()
    if next(it, None) is not None:
        raise ValueError(f"the tensors iterable yields more than the {len(metas)} metas")
    if cuda:
        torch.cuda.synchronize()  # the non-blocking copies must land before delivery reads the buffer
    buf.tensors = out
    return nbytes
