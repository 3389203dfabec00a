"""Trainer side of a weight update (rank 0): the HTTP requests to every server and the bucketed broadcast."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict

import httpx
import torch

from pipelinerl.dtypes import dtype_name
from pipelinerl.weights.collective import broadcast_async, open_group, wait_work
from pipelinerl.weights.wire import (
    HTTP_MARGIN_S,
    InitRequest,
    TensorMeta,
    UpdateRequest,
    WeightTransferError,
    plan_buckets,
    tensor_checksum,
    update_body,
)


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
        self._status = {url: self._request(url, "/status") for url in self.server_urls}
        ranks = [s["num_ranks"] for s in self._status.values()]
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        world = 1 + sum(ranks)
        req = InitRequest(self.master_addr, self.master_port, 0, world, self.backend, self.timeout_s)
        posts = self._post_all("/init_process_group", {url: {**asdict(req), "rank_offset": off}
                                                      for url, off in zip(self.server_urls, offsets)})
        opening = self._pool.submit(open_group, req, 0)
        deadline = time.monotonic() + self.timeout_s
        while not opening.done():
            posts.raise_failed()
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out opening the weight group on {self.master_addr}:"
                                   f"{self.master_port}; waiting for {posts.pending()}")
            time.sleep(0.01)
        self._group = opening.result()
        posts.join(deadline)

    def broadcast(self, version: int, metas: list[TensorMeta], tensors: Iterable[torch.Tensor]) -> dict:
        """One update round; returns timings and every server's reply. Raises WeightTransferError."""
        if self._group is None:
            raise WeightTransferError("not connected: call connect() (again, after a failed round)")
        req = UpdateRequest(version, self.bucket_bytes, list(metas), self.checksums)
        self._check_metas(req.tensors)
        started = time.monotonic()
        deadline = started + self.timeout_s
        posts = self._post_all("/request_weight_update", dict.fromkeys(self.server_urls, update_body(req)))
        try:
            send_s, sums = self._send_buckets(req, tensors, deadline, posts)
            if self.checksums:
                self._send(torch.tensor(sums, dtype=torch.int64, device=self._device), deadline, posts,
                           "the checksum tensor")
            replies = posts.join(deadline + HTTP_MARGIN_S)
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
                      posts: Replies) -> tuple[float, list[int]]:
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

    def _send(self, tensor: torch.Tensor, deadline: float, posts: Replies, what: str) -> None:
        self._wait(broadcast_async(self._group, tensor), deadline, posts, what)

    def _wait(self, work, deadline: float, posts: Replies, what: str) -> None:
        wait_work(work, deadline, f"{what} to reach {posts.pending()}", poll=posts.raise_failed)

    def _request(self, url: str, path: str, body: dict | None = None) -> dict:
        """GET (no body) or POST (a JSON body) url + path; the JSON reply, or WeightTransferError."""
        return http_json(url, path, body, self._headers, self.timeout_s + HTTP_MARGIN_S)

    def _post_all(self, path: str, bodies: dict[str, dict]) -> Replies:
        """POST bodies[url] to url + path for every server at once, on the pool."""
        return Replies({url: self._pool.submit(self._request, url, path, body) for url, body in bodies.items()})


class Replies:
    """The servers' pending replies to one request each (the HTTP side of a round, beside the collective)."""

    def __init__(self, futures: dict[str, Future]):
        self.futures = futures

    def raise_failed(self) -> None:
        """A server that answered with an error has failed: stop waiting for it. A success may arrive
        before this side's last collective completes: a receiver can finish before its sender does."""
        for fut in self.futures.values():
            if fut.done():
                fut.result()  # raises WeightTransferError naming the URL

    def join(self, deadline: float) -> dict[str, dict]:
        replies = {}
        for url, fut in self.futures.items():
            try:
                replies[url] = fut.result(timeout=max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                raise TimeoutError(f"timed out waiting for the reply of {url}") from None
        return replies

    def pending(self) -> str:
        return ", ".join(url for url, fut in self.futures.items() if not fut.done()) or "the servers"


def http_json(url: str, path: str, body: dict | None, headers: dict, read_timeout_s: float) -> dict:
    """GET (body None) or POST (JSON body); the JSON reply. WeightTransferError names the URL on a transport
    error or a status other than 200."""
    method = "GET" if body is None else "POST"
    try:
        resp = httpx.request(method, url + path, json=body, headers=headers,
                             timeout=httpx.Timeout(read_timeout_s, connect=10.0))
    except httpx.HTTPError as err:
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
