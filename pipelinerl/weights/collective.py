"""The weight-update process group, shared by both sides: open or join it, broadcast, wait with a deadline,
abandon it.

Every wait has a deadline and its error names the peer it waited for (STYLE 10). Rank 0 (the trainer) hosts
one TCPStore for its whole life; each group rendezvous under its own name in it (InitRequest.group), so the
trainer re-forms the group (a server died, restarted or joined) on the same port. A group is abandoned by
writing `abort` under its name: a server waiting inside a collective of it sees the flag, or the store gone
with a dead trainer, within ABORT_POLL_S and gives up instead of waiting for its deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch

from pipelinerl.weights.wire import InitRequest, WeightTransferError

ABORT_POLL_S = 0.5  # how often a waiting server asks the trainer's store whether the group was abandoned


def master_store(host: str, port: int, timeout_s: float):
    """Rank 0's TCPStore, shared by every group it opens. It never waits for workers: they join through an
    HTTP call its caller is itself waiting on."""
    return torch.distributed.TCPStore(host, port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)


class WeightGroup:
    """A weight-update process group and its name-prefixed view of rank 0's store."""

    def __init__(self, req: InitRequest, rank: int, store=None):
        """Join (rank > 0: a new client of the trainer's store) or open (rank 0: in `store`, its master)."""
        timeout = timedelta(seconds=req.timeout_s)
        if store is None:
            store = torch.distributed.TCPStore(req.master_addr, req.master_port, None, rank == 0, timeout,
                                               wait_for_workers=False)
        self.store = torch.distributed.PrefixStore(f"{req.group}/", store)
        self.backend, self.name, self.master = req.backend, req.group, f"{req.master_addr}:{req.master_port}"
        self._next_poll = 0.0
        if req.backend == "gloo":
            self.pg = torch.distributed.ProcessGroupGloo(self.store, rank, req.world_size, timeout)
        else:
            options = torch.distributed.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = torch.distributed.ProcessGroupNCCL(self.store, rank, req.world_size, options)

    def abandon(self, reason: str) -> None:
        """Rank 0: tell every member to stop waiting (best effort: the store may be unreachable)."""
        try:
            self.store.set("abort", reason)
        except Exception:  # noqa: BLE001 -- a member that cannot read the flag finds the group broken anyway
            pass
        self.close()

    def check_abandoned(self) -> None:
        """A member: WeightTransferError if rank 0 abandoned the group or its store is gone (asks at most
        every ABORT_POLL_S)."""
        now = time.monotonic()
        if now < self._next_poll:
            return
        self._next_poll = now + ABORT_POLL_S
        try:
            abandoned = self.store.check(["abort"])
            reason = self.store.get("abort").decode() if abandoned else ""
        except Exception as err:  # noqa: BLE001 -- any failure to reach the store: the trainer is gone
            raise WeightTransferError(f"lost the store of the trainer at {self.master} ({err.__class__.__name__}): "
                                      "it died or left") from err
        if abandoned:
            raise WeightTransferError(f"the trainer at {self.master} abandoned weight-update group {self.name}: "
                                      f"{reason}")

    def close(self) -> None:
        """Free a communicator stuck on a vanished peer (NCCL); gloo's sockets close with the object."""
        if self.backend == "nccl":
            self.pg.abort()


def open_group(req: InitRequest, rank: int, store=None) -> WeightGroup:
    """Join (rank > 0) or open (rank 0) the weight-update process group `req.group`. The group is private to
    the weight updates, next to each program's own default group."""
    return WeightGroup(req, rank, store)


def wait_work(work, deadline: float, what: str, poll: Callable[[], None] | None = None) -> None:
    """Wait for an async collective; TimeoutError naming `what` after `deadline` (time.monotonic()).

    NCCL has no timeout of its own on a missing peer, so the deadline is enforced here for both
    backends; `poll` lets the caller fail early (e.g. a server already answered with an error).
    """
    pause = 1e-4
    while not work.is_completed():
        if poll is not None:
            poll()
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(pause)
        pause = min(pause * 2, 5e-3)
    try:
        work.wait()
    except RuntimeError as err:
        raise WeightTransferError(f"collective failed while waiting for {what}: {err}") from err


def broadcast_async(group: WeightGroup, tensor: torch.Tensor):
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    return group.pg.broadcast([tensor], opts)
