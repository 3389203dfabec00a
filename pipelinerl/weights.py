"""The weight-update contract between the trainer and the inference servers, both sides.

Wire format (defined once here, imported by the trainer and by the server's worker engine):

1. ``POST /init_process_group`` with an :class:`InitRequest` body; the trainer opens the group as rank 0
   (TCPStore master) while every server joins as ranks ``rank_offset .. rank_offset + num_ranks - 1``
   (one rank per vLLM worker, so tensor parallelism needs no special case).
2. ``POST /request_weight_update`` with an :class:`UpdateRequest` body, then rank 0 broadcasts the
   tensors in ``tensors`` order packed into buckets (:func:`plan_buckets`: greedy, in order, each tensor
   at a 64-byte-aligned offset, a bucket never exceeds ``bucket_bytes`` unless one tensor alone does).
   With ``checksums`` one more int64 tensor follows: the CRC32 of every tensor's bytes.

Every wait has a deadline and its error names the peer it waited for (STYLE 10).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch

ALIGN_BYTES = 64  # tensor offsets inside a bucket: any dtype view of the slice is aligned
WIRE_DTYPES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "int8", "uint8")
HTTP_MARGIN_S = 30.0  # an HTTP reply may take this long beyond the collective's own timeout


class WeightTransferError(RuntimeError):
    """A weight-update round failed; the message names the peer (server URL or trainer address)."""


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of an update: HF parameter name, torch dtype name (e.g. "bfloat16"), full shape."""

    name: str
    dtype: str
    shape: list[int]

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * torch.empty((), dtype=torch_dtype(self.dtype)).element_size()


@dataclass(frozen=True)
class InitRequest:
    """Body of POST /init_process_group."""

    master_addr: str  # host of the trainer's TCPStore (rank 0)
    master_port: int  # its port
    rank_offset: int  # rank of this server's first worker in the group (>= 1)
    world_size: int  # 1 trainer rank + every worker of every server
    backend: str  # "nccl" (GPU) | "gloo" (CPU)
    timeout_s: float  # every collective of the group fails after this many seconds


@dataclass(frozen=True)
class UpdateRequest:
    """Body of POST /request_weight_update."""

    version: int  # the policy version the new weights are (the trainer's optimizer step)
    bucket_bytes: int  # bucket size the trainer packs with (both sides run plan_buckets)
    tensors: list[TensorMeta]  # every tensor about to be broadcast, in broadcast order
    checksums: bool = False  # a CRC32 tensor follows the buckets; the server checks before loading


@dataclass(frozen=True)
class Bucket:
    indexes: list[int]  # positions in the tensor list
    offsets: list[int]  # byte offset of each tensor inside the bucket
    nbytes: int


def torch_dtype(name: str) -> torch.dtype:
    if name not in WIRE_DTYPES:
        raise ValueError(f"dtype {name!r} is not a wire dtype; use one of {', '.join(WIRE_DTYPES)}")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def parse_init_request(body: object) -> InitRequest:
    """Validate a JSON body; ValueError says what is wrong."""
    _require(isinstance(body, dict), "body must be a JSON object")
    fields = set(InitRequest.__dataclass_fields__)
    _require(set(body) == fields, f"body keys must be exactly {sorted(fields)}; got {sorted(body)}")
    req = InitRequest(**body)
    _require(isinstance(req.master_addr, str) and bool(req.master_addr), "master_addr must be a host name")
    _require(_is_int(req.master_port) and 0 < req.master_port < 65536, "master_port must be in 1..65535")
    _require(_is_int(req.world_size) and req.world_size >= 2, "world_size must be an integer >= 2")
    _require(_is_int(req.rank_offset) and 1 <= req.rank_offset < req.world_size,
             "rank_offset must be in 1..world_size-1 (rank 0 is the trainer)")
    _require(req.backend in ("nccl", "gloo"), f"backend must be 'nccl' or 'gloo', got {req.backend!r}")
    _require(isinstance(req.timeout_s, (int, float)) and req.timeout_s > 0, "timeout_s must be > 0")
    return req


def parse_update_request(body: object) -> UpdateRequest:
    """Validate a JSON body's form (names against the model are checked by the server)."""
    _require(isinstance(body, dict), "body must be a JSON object")
    unknown = set(body) - set(UpdateRequest.__dataclass_fields__)
    _require(not unknown, f"unknown body keys {sorted(unknown)}")
    _require(_is_int(body.get("version")), "version must be an integer")
    _require(_is_int(body.get("bucket_bytes")) and body["bucket_bytes"] > 0, "bucket_bytes must be > 0")
    _require(isinstance(body.get("checksums", False), bool), "checksums must be true or false")
    raw = body.get("tensors")
    _require(isinstance(raw, list) and len(raw) > 0, "tensors must be a non-empty list")
    metas = [_parse_meta(i, t) for i, t in enumerate(raw)]
    names = [m.name for m in metas]
    _require(len(set(names)) == len(names), "tensor names must be unique")
    return UpdateRequest(body["version"], body["bucket_bytes"], metas, body.get("checksums", False))


def _parse_meta(i: int, t: object) -> TensorMeta:
    _require(isinstance(t, dict) and set(t) == {"name", "dtype", "shape"},
             f"tensors[{i}] must be an object with keys name, dtype, shape")
    _require(isinstance(t["name"], str), f"tensors[{i}].name must be a string")
    _require(t["dtype"] in WIRE_DTYPES, f"tensors[{i}].dtype {t['dtype']!r} is not one of {WIRE_DTYPES}")
    _require(isinstance(t["shape"], list) and all(_is_int(d) and d >= 0 for d in t["shape"]),
             f"tensors[{i}].shape must be a list of non-negative integers")
    return TensorMeta(t["name"], t["dtype"], list(t["shape"]))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def update_body(req: UpdateRequest) -> dict:
    return {**asdict(req), "tensors": [asdict(m) for m in req.tensors]}


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Greedy in-order packing; both sides call this, so they cut the stream at the same places."""
    buckets, indexes, offsets, used = [], [], [], 0
    for i, meta in enumerate(metas):
        start = -(-used // ALIGN_BYTES) * ALIGN_BYTES
        if indexes and start + meta.nbytes > bucket_bytes:
            buckets.append(Bucket(indexes, offsets, used))
            indexes, offsets, start = [], [], 0
        indexes.append(i)
        offsets.append(start)
        used = start + meta.nbytes
    if indexes:
        buckets.append(Bucket(indexes, offsets, used))
    return buckets


def tensor_checksum(t: torch.Tensor) -> int:
    """CRC32 of the tensor's bytes (debug option: catches corruption and ordering bugs)."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return zlib.crc32(memoryview(data))


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


def receive_staged(group, req: UpdateRequest, device: torch.device, deadline: float,
                   peer: str) -> list[tuple[str, torch.Tensor]]:
    """Server side: receive every bucket, return (name, CPU tensor) pairs; nothing is loaded here.

    On CPU the bucket buffers are the staging memory (tensors are views into them); on GPU each bucket
    lands in device memory and is copied to host, so staging costs host RAM, not GPU memory.
    """
    staged: list[tuple[str, torch.Tensor]] = []
    buckets = plan_buckets(req.tensors, req.bucket_bytes)
    for k, bucket in enumerate(buckets):
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        wait_work(broadcast_async(group, buf), deadline, f"bucket {k + 1}/{len(buckets)} from {peer}")
        buf = buf.cpu()
        for i, off in zip(bucket.indexes, bucket.offsets):
            meta = req.tensors[i]
            view = buf[off:off + meta.nbytes].view(torch_dtype(meta.dtype)).view(meta.shape)
            staged.append((meta.name, view))
    if req.checksums:
        _check_checksums(group, staged, device, deadline, peer)
    return staged


def _check_checksums(group, staged, device, deadline: float, peer: str) -> None:
    sums = torch.empty(len(staged), dtype=torch.int64, device=device)
    wait_work(broadcast_async(group, sums), deadline, f"the checksum tensor from {peer}")
    bad = [name for (name, t), s in zip(staged, sums.cpu().tolist()) if tensor_checksum(t) != s]
    if bad:
        raise WeightTransferError(f"checksum mismatch on {len(bad)} tensor(s) from {peer}: {bad[:5]}")


class WeightBroadcaster:
    """Trainer side (rank 0): opens the group with every server and broadcasts each new version.

    After a failed round the group is unusable (some servers may still wait inside a collective until
    their timeout); `broadcast` then refuses until `connect` is called again.
    """

    def __init__(self, server_urls: list[str], backend: str, master_addr: str, master_port: int,
                 timeout_s: float, bucket_bytes: int, token: str | None, checksums: bool = False):
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
        if not server_urls:
            raise ValueError("no inference servers to broadcast to (RUN_DIR/servers/ is empty?)")
        self.server_urls = [u.rstrip("/") for u in server_urls]
        self.backend, self.master_addr, self.master_port = backend, master_addr, master_port
        self.timeout_s, self.bucket_bytes, self.checksums = timeout_s, bucket_bytes, checksums
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._pool = ThreadPoolExecutor(max_workers=len(server_urls) + 1, thread_name_prefix="weights")
        self._group = None
        self._status: dict[str, dict] = {}
        self._device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None

    def connect(self) -> None:
        """POST /init_process_group to every server while opening the group as rank 0."""
        self._status = {url: self._get(url, "/status") for url in self.server_urls}
        ranks = [s["num_ranks"] for s in self._status.values()]
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        world = 1 + sum(ranks)
        req = InitRequest(self.master_addr, self.master_port, 0, world, self.backend, self.timeout_s)
        posts = {url: self._pool.submit(self._post, url, "/init_process_group",
                                        {**asdict(req), "rank_offset": off})
                 for url, off in zip(self.server_urls, offsets)}
        opening = self._pool.submit(open_group, req, 0)
        deadline = time.monotonic() + self.timeout_s
        while not opening.done():
            self._raise_failed(posts)
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out opening the weight group on {self.master_addr}:"
                                   f"{self.master_port}; waiting for {self._pending(posts)}")
            time.sleep(0.01)
        self._group = opening.result()
        self._join(posts, deadline)

    def broadcast(self, version: int, metas: list[TensorMeta], tensors: Iterable[torch.Tensor]) -> dict:
        """One update round; returns timings and every server's reply. Raises WeightTransferError."""
        if self._group is None:
            raise WeightTransferError("not connected: call connect() (again, after a failed round)")
        req = UpdateRequest(version, self.bucket_bytes, list(metas), self.checksums)
        self._check_metas(req.tensors)
        started = time.monotonic()
        deadline = started + self.timeout_s
        posts = {url: self._pool.submit(self._post, url, "/request_weight_update", update_body(req))
                 for url in self.server_urls}
        try:
            send_s, sums = self._send_buckets(req, tensors, deadline, posts)
            if self.checksums:
                self._send(torch.tensor(sums, dtype=torch.int64, device=self._device), deadline, posts,
                           "the checksum tensor")
            replies = self._join(posts, deadline + HTTP_MARGIN_S)
        except BaseException:
            self._group = None  # the collective sequence is broken; servers fall back on their own
            raise
        bad = {url: r.get("version") for url, r in replies.items() if r.get("version") != version}
        if bad:
            raise WeightTransferError(f"servers acknowledged other versions than {version}: {bad}")
        total = time.monotonic() - started
        nbytes = sum(m.nbytes for m in req.tensors)
        return {"version": version, "bytes": nbytes, "total_s": total, "broadcast_s": send_s,
                "gbps": nbytes / max(send_s, 1e-9) / 1e9, "servers": replies}

    def _check_metas(self, metas: list[TensorMeta]) -> None:
        """Check against what each server serves before any collective starts: a server that rejects
        the request after the broadcast began would leave this side's group stuck until its timeout."""
        for url, status in self._status.items():
            expected, dtype = status["tensors"], status["dtype"]
            wrong = [m.name for m in metas if expected.get(m.name) != m.shape or m.dtype != dtype]
            missing = sorted(expected.keys() - {m.name for m in metas})
            if wrong or missing:
                raise ValueError(f"{url} serves {dtype} tensors that do not match the update: wrong or unknown "
                                 f"{wrong[:5]}, missing {missing[:5]}")

    def close(self) -> None:
        self._group = None
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _send_buckets(self, req: UpdateRequest, tensors: Iterable[torch.Tensor], deadline: float,
                      posts: dict) -> tuple[float, list[int]]:
        """Pack and send bucket by bucket; two buffers let packing overlap the previous send."""
        it: Iterator[torch.Tensor] = iter(tensors)
        sums: list[int] = []
        in_flight: list = []
        send_s = 0.0
        for k, bucket in enumerate(plan_buckets(req.tensors, req.bucket_bytes)):
            buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self._device)
            for i, off in zip(bucket.indexes, bucket.offsets):
                t = _next_checked(it, req.tensors[i])
                buf[off:off + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
                if self.checksums:
                    sums.append(tensor_checksum(t))
            t0 = time.monotonic()
            if len(in_flight) == 2:
                work, _, label = in_flight.pop(0)
                self._wait(work, deadline, posts, label)
            # the buffer stays referenced until its broadcast is waited for
            in_flight.append((broadcast_async(self._group, buf), buf, f"bucket {k + 1}"))
            send_s += time.monotonic() - t0
        if next(it, None) is not None:
            raise ValueError(f"the tensors iterable yields more than the {len(req.tensors)} metas")
        t0 = time.monotonic()
        for work, _, label in in_flight:
            self._wait(work, deadline, posts, label)
        return send_s + time.monotonic() - t0, sums

    def _send(self, tensor: torch.Tensor, deadline: float, posts: dict, what: str) -> None:
        self._wait(broadcast_async(self._group, tensor), deadline, posts, what)

    def _wait(self, work, deadline: float, posts: dict, what: str) -> None:
        wait_work(work, deadline, f"{what} to reach {self._pending(posts)}",
                  poll=lambda: self._raise_failed(posts))

    def _raise_failed(self, posts: dict[str, Future]) -> None:
        """A server that answered with an error has failed: stop waiting for it. A success may arrive
        before this side's last collective completes: a receiver can finish before its sender does."""
        for fut in posts.values():
            if fut.done():
                fut.result()  # raises WeightTransferError naming the URL

    def _join(self, posts: dict[str, Future], deadline: float) -> dict[str, dict]:
        replies = {}
        for url, fut in posts.items():
            try:
                replies[url] = fut.result(timeout=max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                raise TimeoutError(f"timed out waiting for the reply of {url}") from None
        return replies

    @staticmethod
    def _pending(posts: dict[str, Future]) -> str:
        return ", ".join(url for url, fut in posts.items() if not fut.done()) or "the servers"

    def _get(self, url: str, path: str) -> dict:
        return self._http("GET", url, path, None)

    def _post(self, url: str, path: str, body: dict) -> dict:
        return self._http("POST", url, path, body)

    def _http(self, method: str, url: str, path: str, body: dict | None) -> dict:
        import requests

        try:
            resp = requests.request(method, url + path, json=body, headers=self._headers,
                                    timeout=(10.0, self.timeout_s + HTTP_MARGIN_S))
        except requests.RequestException as err:
            raise WeightTransferError(f"{method} {url}{path} failed: {err}") from err
        if resp.status_code != 200:
            raise WeightTransferError(f"{method} {url}{path} -> HTTP {resp.status_code}: {resp.text[:500]}")
        return resp.json()


def _next_checked(it: Iterator[torch.Tensor], meta: TensorMeta) -> torch.Tensor:
    t = next(it, None)
    if t is None:
        raise ValueError(f"the tensors iterable ended before {meta.name!r}")
    if dtype_name(t.dtype) != meta.dtype or list(t.shape) != meta.shape:
        raise ValueError(f"tensor for {meta.name!r} is {dtype_name(t.dtype)} {list(t.shape)}, "
                         f"but its meta says {meta.dtype} {meta.shape}")
    return t
