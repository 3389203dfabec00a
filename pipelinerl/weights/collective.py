"""The weight-update process group, shared by both sides: open or join it, broadcast, wait with a deadline.

Every wait has a deadline and its error names the peer it waited for (STYLE 10).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch

from pipelinerl.weights.wire import InitRequest, WeightTransferError


def open_group(req: InitRequest, rank: int):
    """Join (rank > 0) or open (rank 0: TCPStore master) the weight-update process group.

    The group is private to the weight updates, next to each program's own default group. The master
    store must not wait for workers: they join through an HTTP call its caller is itself waiting on.
    """
    timeout = timedelta(seconds=req.timeout_s)
    store = torch.distributed.TCPStore(req.master_addr, req.master_port, req.world_size,
                                       is_master=(rank == 0), timeout=timeout, wait_for_workers=False)
    if req.backend == "gloo":
        return torch.distributed.ProcessGroupGloo(store, rank, req.world_size, timeout)
    options = torch.distributed.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return torch.distributed.ProcessGroupNCCL(store, rank, req.world_size, options)


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


def broadcast_async(group, tensor: torch.Tensor):
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([tensor], opts)


