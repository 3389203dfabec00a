"""The weight-update process group, shared by both sides: open or join it, broadcast, wait with a deadline,
abandon it.

Every wait has a deadline and its error names the peer it waited for (STYLE 10). Rank 0 (the trainer) hosts
one TCPStore for its whole life; each group rendezvous under its own name in it (InitRequest.group), so the
trainer re-forms the group (a server died, restarted or joined) on the same port. A group is abandoned by
writing `abort` under its name: a server waiting inside a collective of it sees the flag, or the store gone
with a dead trainer, within ABORT_POLL_S and gives up instead of waiting for its deadline.

Opening a group is two-phase, so that nobody blocks inside torch's rendezvous on a member that never comes
(it holds its store connection until its own timeout): each member announces itself (`joined/<rank>`) and
waits for rank 0's `go`; rank 0 says `go` once every member is there. Both waits are polls that give up on
the abandon flag (members) or on the caller's `stop` (rank 0: a server's /init_process_group failed). Rank 0
opens each group on a store connection of its own (`group_store`): one abandoned open stuck in torch's
rendezvous then cannot hold up the next.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from datetime import timedelta
from threading import Thread

import torch

from pipelinerl.netif import use_interface
from pipelinerl.weights.wire import InitRequest, WeightTransferError

# After every member said `joined`, the group's own rendezvous (each rank publishes its address in the store
# and reads the others') takes well under a second; this bounds it, so that a member that died between the
# two (its /init_process_group cut short) fails the others within this instead of after req.timeout_s, which
# bounds collectives (a whole update) and is 600 s by default. It covers the communicator's construction and
# connection on both backends (_connect).
RENDEZVOUS_S = 30.0
ABORT_POLL_S = 0.5  # how often a waiting server asks the trainer's store whether the group was abandoned
JOIN_POLL_S = 0.02  # how often the two-phase open checks its keys


def master_store(host: str, port: int, timeout_s: float):
    """Rank 0's TCPStore, shared by every group it opens. It never waits for workers: they join through an
    HTTP call its caller is itself waiting on."""
    return torch.distributed.TCPStore(host, port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)


def group_store(req: InitRequest):
    """A new client connection to the store at `req`'s master address (which must be up)."""
    return torch.distributed.TCPStore(req.master_addr, req.master_port, None, False, timedelta(seconds=req.timeout_s))


class WeightGroup:
    """A weight-update process group and its name-prefixed view of rank 0's store."""

    def __init__(self, req: InitRequest, rank: int, store=None, stop: Callable[[], None] | None = None,
                 cpus: Iterable[int] | None = None):
        """Join (rank > 0: a new client of the trainer's store) or open (rank 0: in `store`, else as the
        store's master). `stop` (rank 0) is called while members are awaited and may raise to give up.
        `cpus`: the cores gloo's threads may run on (None: the calling thread's cores)."""
        timeout = timedelta(seconds=req.timeout_s)
        if store is None:
            store = torch.distributed.TCPStore(req.master_addr, req.master_port, None, rank == 0, timeout,
                                               wait_for_workers=False)
        self.store = torch.distributed.PrefixStore(f"{req.group}/", store)
        self.backend, self.name, self.master = req.backend, req.group, f"{req.master_addr}:{req.master_port}"
        self.master_addr = req.master_addr
        self.timeout = timeout
        self._next_poll = 0.0
        deadline = time.monotonic() + req.timeout_s
        if rank == 0:
            self._await([f"joined/{r}" for r in range(1, req.world_size)], deadline, stop, "members")
            self.store.set("go", "1")
        else:
            self.store.set(f"joined/{rank}", "1")
            self._await(["go"], deadline, self.check_abandoned, "the trainer's go")
        poll = stop if rank == 0 else self.check_abandoned
        self.pg = _connect(self, rank, req.world_size, timedelta(seconds=min(req.timeout_s, RENDEZVOUS_S)), poll,
                           cpus)
        if req.backend == "gloo":
            self.pg.set_timeout(timeout)  # ProcessGroupGloo.set_timeout applies to the ops issued after it

    def _await(self, keys: list[str], deadline: float, poll: Callable[[], None] | None, what: str) -> None:
        while not self.store.check(keys):
            if poll is not None:
                poll()
            if time.monotonic() > deadline:
                missing = [k for k in keys if not self.store.check([k])]
                raise TimeoutError(f"timed out opening weight-update group {self.name} at {self.master}: waiting "
                                   f"for {what} ({', '.join(missing)})")
            time.sleep(JOIN_POLL_S)

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


def _connect(group: WeightGroup, rank: int, world_size: int, bound: timedelta, poll: Callable[[], None] | None,
             cpus: Iterable[int] | None):
    """The group's communicator, connected to every member within `bound`, else WeightTransferError naming the
    group. Made on a daemon thread (`_communicator`) while this one polls `poll` (rank 0's stop, a member's
    abandon check) and the deadline: gloo's connect and NCCL's communicator init block their thread, and
    NCCL's has no timeout of its own. A communicator that connects after its caller gave up is aborted."""
    made = on_thread(lambda: _communicator(group, rank, world_size, bound, cpus), f"weights-{group.backend}")
    deadline = time.monotonic() + bound.total_seconds()
    why = f"not every member connected within {bound.total_seconds():.0f} s of joining (one died?)"
    try:
        while not made.done():
            if poll is not None:
                poll()
            if time.monotonic() > deadline:
                raise WeightTransferError(f"weight-update group {group.name} at {group.master}: {why}")
            time.sleep(JOIN_POLL_S)
    except BaseException:
        if group.backend == "nccl":
            made.add_done_callback(lambda f: f.exception() is None and f.result().abort())
        raise
    try:
        return made.result()
    except RuntimeError as err:  # torch's DistStoreError / gloo's connect errors / NCCL's
        raise WeightTransferError(f"weight-update group {group.name} at {group.master}: {why}: {err}") from err


# TORCH_NCCL_ASYNC_ERROR_HANDLING, read when a ProcessGroupNCCL is constructed: 0 leaves the process alone on
# an asynchronous NCCL error (torchrun sets 1: tear the process down), as torch says for groups their owner
# aborts itself. Every wait on this group has its own deadline and a failure aborts the group (close), so one
# server dying mid-update must neither kill the trainer nor, through the trainer's abort, every other server.
NCCL_ERROR_HANDLING = "0"


def _communicator(group: WeightGroup, rank: int, world_size: int, bound: timedelta, cpus: Iterable[int] | None):
    """Build and connect the group's communicator (blocking; see _connect). Gloo starts its threads (the TCP
    loop that copies the bytes, its workers) in the constructor and they keep the creating thread's CPU
    affinity: a vLLM CPU worker binds itself to its compute cores (one core on a 2-core machine), where the
    receive would then share one core with everything else the worker does; so this thread may run on `cpus`.
    Gloo connects in its constructor, made with `bound` as its timeout (its connect waits that long for each
    peer); NCCL lazily, so its communicator is connected here (eager init, then a one-element broadcast)."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # this thread only: 0 is the calling thread on Linux
    use_interface(group.master_addr)  # gloo's and NCCL's sockets: not a loopback name (netif.py)
    if group.backend == "gloo":
        return torch.distributed.ProcessGroupGloo(group.store, rank, world_size, bound)
    options = torch.distributed.ProcessGroupNCCL.Options()
    options._timeout = group.timeout
    saved = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = NCCL_ERROR_HANDLING
    try:
        pg = torch.distributed.ProcessGroupNCCL(group.store, rank, world_size, options)
    finally:
        if saved is None:
            os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        else:
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = saved
    device = torch.device("cuda", torch.cuda.current_device())
    pg.eager_connect_single_device(device)
    _broadcast(pg, torch.zeros(1, device=device)).wait()
    return pg


def on_thread(fn: Callable[[], object], name: str) -> Future:
    """Run `fn` on a daemon thread of its own; its result or error in the Future. Not a ThreadPoolExecutor:
    an exiting interpreter joins every pool thread, so one call stuck on a hung server (an HTTP reply, a
    collective) would keep the process from exiting after its stop signal."""
    done: Future = Future()

    def run() -> None:
        try:
            done.set_result(fn())
        except BaseException as err:  # noqa: BLE001 -- handed to the waiting caller
            done.set_exception(err)

    Thread(target=run, name=name, daemon=True).start()
    return done


def map_on_threads(fn: Callable[[object], object], items: Iterable, name: str) -> list:
    """[fn(x) for x in items], each on a daemon thread of its own (on_thread), at once."""
    futures = [on_thread(lambda x=x: fn(x), name) for x in items]
    return [f.result() for f in futures]


def open_group(req: InitRequest, rank: int, store=None, stop: Callable[[], None] | None = None,
               cpus: Iterable[int] | None = None) -> WeightGroup:
    """Join (rank > 0) or open (rank 0) the weight-update process group `req.group`. The group is private to
    the weight updates, next to each program's own default group. `cpus`: the cores gloo's threads may use
    (None: the calling thread's)."""
    return WeightGroup(req, rank, store, stop, cpus)


def abandon_open(store, group: str, reason: str) -> None:
    """Rank 0: flag group `group` abandoned before it was open (best effort), so members stop waiting."""
    try:
        torch.distributed.PrefixStore(f"{group}/", store).set("abort", reason)
    except Exception:  # noqa: BLE001 -- members waiting on a store they cannot reach find it broken anyway
        pass


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
    return _broadcast(group.pg, tensor)


def _broadcast(pg, tensor: torch.Tensor):
    """Rank 0's `tensor` to every member of process group `pg` (its async Work)."""
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([tensor], opts)
