"""Trainer side of a weight update (rank 0): the HTTP requests to every server and the bucketed broadcast."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from urllib.parse import urlparse

import torch

from pipelinerl.control import ControlClient, ControlError, ServerStatus
from pipelinerl.dtypes import dtype_name
from pipelinerl.netif import route_source
from pipelinerl.weights.collective import (
    WeightGroup,
    abandon_open,
    broadcast_async,
    group_store,
    map_on_threads,
    master_store,
    on_thread,
    open_group,
    wait_work,
)
from pipelinerl.weights.deadline import LATE_GRACE_S, DeadlineRule, MembersLate, PhaseDeadline
from pipelinerl.weights.delta import Delta, DeltaEncoder
from pipelinerl.weights.replies import Replies
from pipelinerl.weights.wire import (
    HTTP_MARGIN_S,
    InitRequest,
    Part,
    TensorMeta,
    UpdateRequest,
    WeightTransferError,
    itemsize,
    plan_buckets,
    tensor_checksum,
    update_body,
    wire_parts,
)

log = logging.getLogger(__name__)

JOIN_WAIT_S = 30.0  # connect: how long a server may stay busy (with an update the trainer abandoned)
RELEASE_WAIT_S = 30.0  # close: how long to wait for abandoned groups to be destroyed
REFUSAL_GRACE_S = 10.0  # a failed collective: how long to wait for a server's own error reply, which names it


class WeightBroadcaster:
    """Trainer side (rank 0): one weight-update group with some servers, and its rounds. The transport that
    weights/delivery.py drives (which servers, when, what after a failure); tests and tools drive it directly.

    `connect(urls)` (re-)forms the group with every server of `urls` that answers; the members are
    `server_urls`, those left out and why `left_out`. With `delta` (trainer.broadcast_delta), tensors are sent
    as deltas against the previous version (delta.py) whenever every member holds that version as its base,
    and the servers keep a base.
    Every `checksum_every`-th version (0: never) the servers check each resulting tensor's CRC32 before
    loading. After a failed round the group is abandoned (its members stop waiting: collective.py) and
    `broadcast` refuses until `connect` is called again. With `deadline` (trainer.delivery_deadline_*), forming
    the group and each round must end within a deadline from their recent times (deadline.py), else they are
    abandoned and MembersLate names the members still silent. One exception: a round whose every byte arrived but
    that a server rejected (a checksum mismatch; the group stays usable) is resent dense at once when the
    weights are at hand (delta mode keeps them).
    """

    def __init__(self, server_urls: list[str], backend: str, master_addr: str | None, master_port: int,
                 timeout_s: float, bucket_bytes: int, token: str | None, checksum_every: int = 0,
                 delta: bool = False, deadline: DeadlineRule | None = None):
        """`master_addr` None: the local address on the route to the first server connected (broadcast_address)."""
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
        self.server_urls = [u.rstrip("/") for u in server_urls]
        self.left_out: dict[str, str] = {}
        self.backend, self.master_addr, self.master_port = backend, master_addr, master_port
        self.timeout_s, self.bucket_bytes, self.checksum_every = timeout_s, bucket_bytes, checksum_every
        self._control = ControlClient(token, timeout_s + HTTP_MARGIN_S)
        self._store = None  # rank 0's TCPStore, opened at the first connect and kept (collective.py)
        self._name, self._groups = secrets.token_hex(4), 0  # group names: unique to this broadcaster
        self._group: WeightGroup | None = None
        self._releasing: list[threading.Thread] = []  # abandoned groups being destroyed
        self._status: dict[str, ServerStatus] = {}
        self._bases: dict[str, int | None] = {}  # each server's delta base version (None: none)
        self._encoder = DeltaEncoder(pin=backend == "nccl") if delta else None
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        self._buffers: list[torch.Tensor | None] = [None, None]  # the two bucket buffers (_send_buckets)
        self._deadlines = {} if deadline is None else {"connect": PhaseDeadline(deadline),
                                                       "round": PhaseDeadline(deadline)}

    @property
    def connected(self) -> bool:
        return self._group is not None

    def connect(self, urls: list[str] | None = None) -> list[str]:
        """Form the group with every server of `urls` (default: the current members) that answers /status
        and is not in the middle of an update (waiting up to JOIN_WAIT_S for one that is: its update fails
        soon after its trainer abandoned it); returns the members. Abandons the current group first.
        WeightTransferError when no server can join."""
        if self._group is not None:
            self._abandon("the trainer re-forms its weight-update group")
        urls = [u.rstrip("/") for u in (urls or self.server_urls)]
        if not urls:
            raise ValueError("no inference servers to broadcast to (RUN_DIR/servers/ is empty?)")
        if self.master_addr is None:
            self.master_addr = broadcast_address(None, urls[0])
        started = time.monotonic()
        deadline = started + self._limit("connect")
        ready = dict(zip(urls, map_on_threads(lambda u: self._ready_status(u, deadline), urls, "weights-status")))
        self.left_out = {url: str(s) for url, s in ready.items() if isinstance(s, ControlError)}
        for url, why in self.left_out.items():
            log.warning("weight-update group: leaving out %s: %s", url, why)
        self._status = {url: s for url, s in ready.items() if not isinstance(s, ControlError)}
        if not self._status:
            self.server_urls = []
            raise WeightTransferError(f"no server can join the weight-update group: {self.left_out}")
        self.server_urls = list(self._status)
        self._bases = {url: s.delta_base for url, s in self._status.items()}
        self._open_group(deadline)
        self._record("connect", time.monotonic() - started)
        return self.server_urls

    def _limit(self, phase: str, nbytes: int = 0) -> float:
        """Seconds a phase ("connect", "round") moving `nbytes` may take: its deadline, within timeout_s."""
        phase_deadline = self._deadlines.get(phase)
        return self.timeout_s if phase_deadline is None else min(self.timeout_s, phase_deadline.seconds(nbytes))

    def _record(self, phase: str, seconds: float, nbytes: int = 0) -> None:
        if phase in self._deadlines:
            self._deadlines[phase].record(seconds, nbytes)

    def _late(self, phase: str, posts: Replies, err: BaseException, limit_s: float, finished: set[str]) -> MembersLate:
        """The phase missed its deadline and was abandoned; `finished`: the members that had replied by then. Late:
        those still silent LATE_GRACE_S on (stopped); if none, those unfinished while others had finished (slow,
        though alive: they answered the abandonment); if none, nobody (the deadline was short: widened)."""
        silent, answered = posts.silent_after(LATE_GRACE_S)
        unfinished = [url for url in posts.futures if url not in finished] if finished else []
        late = silent or unfinished
        if not late and phase in self._deadlines:
            self._deadlines[phase].widen()
        who = (f"{', '.join(silent)} still silent {LATE_GRACE_S:.0f} s after it was abandoned" if silent else
               f"{', '.join(unfinished)} unfinished while {', '.join(sorted(finished))} had finished" if late else
               "every member answered once it was abandoned: the next one gets the ceiling")
        return MembersLate(f"weight-update {phase} missed its deadline of {limit_s:.1f} s ({err}); {who}", late,
                           answered)

    def _ready_status(self, url: str, deadline: float) -> ServerStatus | ControlError:
        """`url`'s /status once it is not busy with an update, by `deadline` and within JOIN_WAIT_S."""
        started = time.monotonic()
        deadline = min(deadline, started + JOIN_WAIT_S)
        try:
            while (status := self._control.status(url, max(deadline - time.monotonic(), 0.1))).updating:
                if time.monotonic() > deadline:
                    return WeightTransferError(f"{url} is still busy with an update after {deadline - started:.0f} s")
                time.sleep(0.2)
        except ControlError as err:
            return err
        return status

    def _open_group(self, deadline: float) -> None:
        """POST /init_process_group to every member while opening the group as rank 0, on a thread of its own
        and a store connection of its own (collective.py): an attempt given up (a member failed) is flagged
        abandoned and may linger there without holding up the next one."""
        if self._store is None:
            self._store = master_store(self.master_addr, self.master_port, self.timeout_s)
        self._groups += 1
        ranks = [s.num_ranks for s in self._status.values()]
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        req = InitRequest(self.master_addr, self.master_port, 0, 1 + sum(ranks), self.backend, self.timeout_s,
                          f"{self._name}.{self._groups}")
        posts = self._post_all("/init_process_group", {url: {**asdict(req), "rank_offset": off}
                                                      for url, off in zip(self.server_urls, offsets)})
        given_up = threading.Event()
        opening = on_thread(lambda: open_group(req, 0, group_store(req), stop=lambda: _raise_if(given_up)),
                            "weights-open")
        limit_s = deadline - time.monotonic()
        try:
            while not opening.done():
                posts.raise_failed()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"timed out opening the weight group on {self.master_addr}:"
                                       f"{self.master_port}; waiting for {posts.pending()}")
                time.sleep(0.01)
            self._group = opening.result()
        except BaseException as err:
            given_up.set()
            abandon_open(self._store, req.group, f"the trainer gave up opening it: {err}")
            if isinstance(err, TimeoutError):  # no member answers before the group opens: silence alone tells
                raise self._late("connect", posts, err, limit_s, set()) from err
            raise
        try:  # a member that joined the collective and then stopped never replies: late, like one that never joined
            posts.join(deadline)
        except TimeoutError as err:
            finished = posts.done()
            self._abandon(f"the group opened but a member never replied: {err}")
            raise self._late("connect", posts, err, limit_s, finished) from err
        log.info("weight-update group open with %d server(s) (%s): %s", len(self.server_urls), req.group,
                 ", ".join(self.server_urls))

    def _abandon(self, reason: str) -> None:
        """Flag the group abandoned and let it go. Destroying a gloo group waits for its pending collectives
        (up to the group's timeout, with a hung member): the last reference is dropped on a thread of its own,
        which close() waits for (briefly: a C++ group torn down by the interpreter's exit aborts the process)."""
        if self._group is None:
            return
        self._group.abandon(reason)
        held = [self._group]
        self._group = None
        self._releasing.append(threading.Thread(target=held.clear, name="weights-release", daemon=True))
        self._releasing[-1].start()

    def broadcast(self, version: int, metas: list[TensorMeta], tensors: Iterable[torch.Tensor],
                  dense: bool = False) -> dict:
        """One update round; returns timings, bytes and every server's reply. Raises WeightTransferError.
        `dense`: every tensor whole this round, even in delta mode (whose base is still kept)."""
        if self._group is None:
            raise WeightTransferError("not connected: call connect() (again, after a failed round)")
        metas = list(metas)
        self._check_metas(metas)
        checksums = self.checksum_every > 0 and version % self.checksum_every == 0
        if self._encoder is None:
            sums: list[int] = []
            req = UpdateRequest(version, self.bucket_bytes, metas, checksums)
            return self._round(req, _checksummed(tensors, sums) if checksums else tensors, sums)
        try:
            return self._delta_broadcast(version, metas, tensors, checksums, dense)
        except BaseException:
            self._encoder.version = None  # the base holds weights that not every server may have
            raise

    def _delta_broadcast(self, version: int, metas: list[TensorMeta], tensors: Iterable[torch.Tensor],
                         checksums: bool, dense: bool) -> dict:
        """Encode every tensor first (the whole gather, before any server is asked), then send."""
        enc = self._encoder
        shared = enc.version is not None and all(b == enc.version for b in self._bases.values())
        base = enc.version if shared and not dense else None
        started = time.monotonic()
        pieces, changed, compared = [], 0, 0
        it = iter(tensors)
        for meta in metas:
            piece, k = enc.encode(meta, _next_checked(it, meta), base is not None)
            pieces.append(piece)
            if k >= 0:
                changed, compared = changed + k, compared + meta.nbytes // itemsize(meta.dtype)
        if next(it, None) is not None:
            raise ValueError(f"the tensors iterable yields more than the {len(metas)} metas")
        encode_s = time.monotonic() - started
        nnz = [p.values.numel() if isinstance(p, Delta) else -1 for p in pieces] if base is not None else None
        sums = [tensor_checksum(enc.base[m.name]) for m in metas] if checksums else []
        req = UpdateRequest(version, self.bucket_bytes, metas, checksums, base, nnz, keep_base=True)
        try:
            result = self._round(req, _part_tensors(pieces), sums, may_resend=True)
        except UpdateRejectedByServers as err:
            log.warning("weight update %d rejected: %s; resending it dense, with checksums", version, err)
            dense = UpdateRequest(version, self.bucket_bytes, metas, True, keep_base=True)
            result = self._round(dense, (enc.base[m.name] for m in metas),
                                 [tensor_checksum(enc.base[m.name]) for m in metas])
            result["resent_dense"] = 1
        enc.version = version
        result.update(encode_s=encode_s, dense_bytes=sum(m.nbytes for m in metas),
                      delta_tensors=sum(k >= 0 for k in (nnz or [])))
        if compared:
            result["changed_fraction"] = changed / compared
        return result

    def _round(self, req: UpdateRequest, parts: Iterable[torch.Tensor], sums: list[int],
               may_resend: bool = False) -> dict:
        """Post `req` to every server, broadcast its parts (then the checksums), collect the replies. With
        `may_resend`, a round every server received but some rejected keeping their group raises
        UpdateRejectedByServers with the group still open."""
        started = time.monotonic()
        nbytes = sum(p.nbytes for p in wire_parts(req))
        limit_s = self._limit("round", nbytes)
        deadline = started + limit_s
        # A round deadline (deadline.py) covers the replies too: they are part of the time it was measured on.
        replies_by = deadline if "round" in self._deadlines else deadline + HTTP_MARGIN_S
        packer = _Packer(req, parts, self._buffer)
        first = packer.pack(0)  # before the servers pause: gathering and packing bucket 1 stays off their pause
        posts = self._post_all("/request_weight_update", dict.fromkeys(self.server_urls, update_body(req)))
        try:
            send_s = self._send_buckets(packer, first, deadline, posts)
            if req.checksums:
                self._send(torch.tensor(sums, dtype=torch.int64, device=self.device), deadline, posts,
                           "the checksum tensor")
            replies, errors = posts.settle(replies_by)
        except BaseException as err:
            finished = posts.done()  # before the members hear of the abandonment
            self._abandon(f"update {req.version} failed on the trainer: {err}")  # the members stop waiting
            self._buffers = [None, None]  # an abandoned send may still read them: the next round takes new ones
            if isinstance(err, TimeoutError):
                raise self._late("round", posts, err, limit_s, finished) from err
            raise
        if errors:
            if may_resend and all(err.body.get("group_ready") for err in errors.values()):
                raise UpdateRejectedByServers(errors)
            self._abandon(f"update {req.version} failed on {', '.join(errors)}")
            raise next(iter(errors.values()))
        bad = {url: r.get("version") for url, r in replies.items() if r.get("version") != req.version}
        if bad:
            self._abandon(f"servers acknowledged other versions than {req.version}")
            raise WeightTransferError(f"servers acknowledged other versions than {req.version}: {bad}")
        self._bases = {url: r.get("delta_base") for url, r in replies.items()}
        self._record("round", time.monotonic() - started, nbytes)
        return {"version": req.version, "bytes": nbytes, "total_s": time.monotonic() - started,
                "broadcast_s": send_s, "gbps": nbytes / max(send_s, 1e-9) / 1e9, "servers": replies}

    def _check_metas(self, metas: list[TensorMeta]) -> None:
        """Check against what each server serves before any collective starts: a server that rejects
        the request after the broadcast began would leave this side's group stuck until its timeout."""
        for url, status in self._status.items():
            expected, dtype = status.tensors, status.dtype
            wrong = [m.name for m in metas if expected.get(m.name) != m.shape or m.dtype != dtype]
            missing = sorted(expected.keys() - {m.name for m in metas})
            if wrong or missing:
                raise ValueError(f"{url} serves {dtype} tensors that do not match the update: wrong or unknown "
                                 f"{wrong[:5]}, missing {missing[:5]}")

    def close(self, wait_s: float = RELEASE_WAIT_S) -> None:
        """Leave the group; wait up to `wait_s` in all for abandoned groups to be destroyed."""
        self._abandon("the trainer closed its weight-update group")
        deadline = time.monotonic() + wait_s
        for thread in self._releasing:
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))

    def _send_buckets(self, packer: _Packer, first: torch.Tensor, deadline: float, posts: Replies) -> float:
        """Send bucket by bucket (`first`: bucket 1, already packed), through two buffers: bucket k+1 is
        gathered (the iterable may gather ZeRO-3 shards) and packed while bucket k is on the wire. Returns the
        broadcast's wall time: from the first send to the last one completed (packing that does not overlap a
        send counts)."""
        in_flight: dict[int, tuple] = {}  # buffer slot -> (work, label) of the bucket it holds
        first_send = None
        for k, bucket in enumerate(packer.buckets):
            if (pending := in_flight.pop(k % 2, None)) is not None:
                self._wait(pending[0], deadline, posts, pending[1])
            buf = packer.pack(k) if k else first
            if not bucket.nbytes:  # only empty deltas: nothing to send (receiver.py skips it too)
                continue
            first_send = first_send or time.monotonic()
            in_flight[k % 2] = (broadcast_async(self._group, buf), f"bucket {k + 1}")
        packer.check_exhausted()
        for work, label in in_flight.values():
            self._wait(work, deadline, posts, label)
        return time.monotonic() - first_send if first_send is not None else 0.0

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of send buffer `slot` (0 or 1). The two buffers are kept from round to round: a
        fresh one costs a page fault per 4 KiB page on first touch, which halved gloo's bandwidth on CPU."""
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[slot] = torch.empty(max(nbytes, self.bucket_bytes), dtype=torch.uint8,
                                                    device=self.device)
        return buf[:nbytes]

    def _send(self, tensor: torch.Tensor, deadline: float, posts: Replies, what: str) -> None:
        self._wait(broadcast_async(self._group, tensor), deadline, posts, what)

    def _wait(self, work, deadline: float, posts: Replies, what: str) -> None:
        try:
            wait_work(work, deadline, f"{what} to reach {posts.pending()}", poll=posts.raise_failed)
        except WeightTransferError:
            # A server that refused the update (it left the group) closes its end, and gloo's "connection
            # closed by peer" may come before the server's HTTP reply: that reply, naming it, is the error.
            posts.raise_failed(within_s=REFUSAL_GRACE_S)
            raise

    def _request(self, url: str, path: str, body: dict | None = None) -> dict:
        """GET (no body) or POST (a JSON body) url + path; the JSON reply, or ControlError."""
        return self._control.request(url, path, body)

    def _post_all(self, path: str, bodies: dict[str, dict]) -> Replies:
        """POST bodies[url] to url + path for every server at once, each on a daemon thread (on_thread)."""
        return Replies({url: on_thread(lambda url=url, body=body: self._request(url, path, body), "weights-post")
                        for url, body in bodies.items()})


class _Packer:
    """An update's parts packed bucket by bucket (wire.plan_buckets), in order, into the buffer that
    `buffer(slot, nbytes)` returns: bucket k into slot k % 2."""

    def __init__(self, req: UpdateRequest, tensors: Iterable[torch.Tensor],
                 buffer: Callable[[int, int], torch.Tensor]):
        self.req, self.parts, self._it, self._buffer = req, wire_parts(req), iter(tensors), buffer
        self.buckets = plan_buckets(self.parts, req.bucket_bytes)

    def pack(self, k: int) -> torch.Tensor:
        """Bucket k, taking its parts from the tensors iterable (so buckets are packed in order)."""
        bucket = self.buckets[k]
        buf = self._buffer(k % 2, bucket.nbytes)
        for i, off in zip(bucket.indexes, bucket.offsets):
            part = self.parts[i]
            t = _next_checked(self._it, self.req.tensors[part.tensor], part)
            _copy_into(buf[off:off + t.nbytes], t)
        return buf

    def check_exhausted(self) -> None:
        if next(self._it, None) is not None:
            raise ValueError(f"the tensors iterable yields more than the {len(self.parts)} parts of the update")


class UpdateRejectedByServers(WeightTransferError):
    """Every server received the round, some rejected it (wire.UpdateRejected) and kept their group."""

    def __init__(self, errors: dict[str, WeightTransferError]):
        super().__init__("; ".join(str(err) for err in errors.values()))
        self.errors = errors


def broadcast_address(configured: str | None, server_url: str) -> str:
    """`configured` (trainer.broadcast_host), or the local address on the route to the server: loopback on one
    machine; on a cluster, the interface that reaches the servers."""
    if configured:
        return configured
    url = urlparse(server_url)
    return route_source(url.hostname, url.port or 80)


def _raise_if(event: threading.Event) -> None:
    if event.is_set():
        raise WeightTransferError("the trainer gave up this weight-update group")


def _next_checked(it: Iterator[torch.Tensor], meta: TensorMeta, part: Part | None = None) -> torch.Tensor:
    """The next tensor: the whole tensor `meta` describes, or a delta's `part` of it (flat)."""
    t = next(it, None)
    what = meta.name if part is None or part.kind == "dense" else f"{meta.name}'s delta {part.kind}"
    if t is None:
        raise ValueError(f"the tensors iterable ended before {what!r}")
    dtype, shape = (meta.dtype, meta.shape) if part is None or part.kind == "dense" else (part.dtype, [part.numel])
    if dtype_name(t.dtype) != dtype or list(t.shape) != shape:
        raise ValueError(f"tensor for {what!r} is {dtype_name(t.dtype)} {list(t.shape)}, "
                         f"but the update says {dtype} {shape}")
    return t


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A bucket's bytes `dst` <- the bytes of `src`. Host to host as one single-threaded memcpy (through numpy):
    torch's copy_ splits a large copy over its OpenMP threads, which wait for each other when the cores are
    busy (1-2 GB/s instead of 6 on 2 shared cores, measured), and packing must keep up with gloo."""
    if dst.is_cpu and src.is_cpu and src.is_contiguous():
        dst.numpy()[:] = src.detach().reshape(-1).view(torch.uint8).numpy()
    else:
        dst.view(src.dtype).view(src.shape).copy_(src)


def _checksummed(tensors: Iterable[torch.Tensor], sums: list[int]) -> Iterator[torch.Tensor]:
    """The tensors, unchanged, appending each one's CRC32 to `sums` as it passes."""
    for t in tensors:
        sums.append(tensor_checksum(t))
        yield t


def _part_tensors(pieces: list[torch.Tensor | Delta]) -> Iterator[torch.Tensor]:
    """A delta-mode round's parts in wire order (wire_parts): a dense tensor, or a delta's counts, offsets and
    values."""
    for piece in pieces:
        if isinstance(piece, Delta):
            yield from (piece.counts, piece.offsets, piece.values)
        else:
            yield piece
