"""The weight-update wire format: request bodies, their validation, bucket layout and checksums.

Defined once here, imported by the trainer (sender.py) and by the server's worker engine (receiver.py):

1. ``POST /init_process_group`` with an :class:`InitRequest` body; the trainer opens the group as rank 0
   (TCPStore master) while every server joins as ranks ``rank_offset .. rank_offset + num_ranks - 1``
   (its /status ``num_ranks``: 1, its tensor-parallel rank 0 worker, which receives for the others).
2. ``POST /request_weight_update`` with an :class:`UpdateRequest` body, then rank 0 broadcasts the
   request's parts (:func:`wire_parts`, in ``tensors`` order) packed into buckets (:func:`plan_buckets`:
   greedy, in order, each part at a 64-byte-aligned offset, a bucket never exceeds ``bucket_bytes`` unless
   one part alone does). A tensor is one dense part, or, with ``nnz[i] >= 0``, a delta against the
   weights of ``base_version`` (delta.py) in three parts: per block of BLOCK elements, how many of its
   elements changed (int32); the ``nnz[i]`` changed elements' offsets inside their blocks (16 bits each,
   in order); their new values. With ``checksums`` one more int64 tensor follows: the CRC32 of every resulting
   tensor's bytes (after any delta is applied).
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass

import torch

from pipelinerl.control import ControlError
from pipelinerl.dtypes import WIRE_DTYPES, torch_dtype

ALIGN_BYTES = 64  # tensor offsets inside a bucket: any dtype view of the slice is aligned
BLOCK = 1 << 16  # a delta's positions are (block, 16-bit offset in the block): 2 bytes per changed element
HTTP_MARGIN_S = 30.0  # an HTTP reply may take this long beyond the collective's own timeout


class WeightTransferError(ControlError):
    """A weight-update round failed; the message names the peer (server URL or trainer address). From an
    HTTP reply: its `status` and JSON `body` ({"error": ..., "group_ready": ...} from a server)."""


class UpdateRejected(WeightTransferError):
    """Every byte arrived, but the update cannot be applied: a resulting tensor's CRC32 differs from the
    trainer's, or its deltas are against another base. Nothing is loaded and the group stays usable (every
    collective of the round completed), so the trainer may resend dense at once."""


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of an update: HF parameter name, torch dtype name (e.g. "bfloat16"), full shape."""

    name: str
    dtype: str
    shape: list[int]

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class InitRequest:
    """Body of POST /init_process_group."""

    master_addr: str  # host of the trainer's TCPStore (rank 0)
    master_port: int  # its port
    rank_offset: int  # rank of this server's first worker in the group (>= 1)
    world_size: int  # 1 trainer rank + every server's num_ranks (1 each: one receiving worker per server)
    backend: str  # "nccl" (GPU) | "gloo" (CPU)
    timeout_s: float  # every collective of the group fails after this many seconds
    group: str = "weights"  # the group's name in rank 0's store: unique per group the trainer forms


@dataclass(frozen=True)
class UpdateRequest:
    """Body of POST /request_weight_update."""

    version: int  # the policy version the new weights are (the trainer's optimizer step)
    bucket_bytes: int  # bucket size the trainer packs with (both sides run plan_buckets)
    tensors: list[TensorMeta]  # every tensor about to be broadcast, in broadcast order
    checksums: bool = False  # a CRC32 tensor follows the buckets; the server checks before loading
    base_version: int | None = None  # the version the deltas apply to; None: every tensor is dense
    nnz: list[int] | None = None  # per tensor: -1 dense, else a delta of this many changed elements
    keep_base: bool = False  # the server keeps the resulting weights as the base of the next deltas


@dataclass(frozen=True)
class Part:
    """One tensor on the wire, or one half of a tensor's delta."""

    tensor: int  # position in UpdateRequest.tensors
    kind: str  # "dense" (the whole tensor) | a delta's "counts" (per block) | "offsets" (in blocks) | "values"
    dtype: str
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass(frozen=True)
class Bucket:
    indexes: list[int]  # positions in the list of parts (or tensors) packed
    offsets: list[int]  # byte offset of each inside the bucket
    nbytes: int


def itemsize(dtype: str) -> int:
    """Bytes per element of a WIRE_DTYPES name."""
    return torch.empty((), dtype=torch_dtype(dtype)).element_size()


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
    fields, required = set(InitRequest.__dataclass_fields__), set(InitRequest.__dataclass_fields__) - {"group"}
    _require(required <= set(body) <= fields, f"body keys must be {sorted(required)} and optionally group; "
                                              f"got {sorted(body)}")
    req = InitRequest(**body)
    _require(isinstance(req.group, str) and 0 < len(req.group) <= 200, "group must be a name of 1-200 characters")
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
    for flag in ("checksums", "keep_base"):
        _require(isinstance(body.get(flag, False), bool), f"{flag} must be true or false")
    raw = body.get("tensors")
    _require(isinstance(raw, list) and len(raw) > 0, "tensors must be a non-empty list")
    metas = [_parse_meta(i, t) for i, t in enumerate(raw)]
    names = [m.name for m in metas]
    _require(len(set(names)) == len(names), "tensor names must be unique")
    base, nnz = body.get("base_version"), body.get("nnz")
    _require(base is None or _is_int(base), "base_version must be an integer or null")
    _require((base is None) == (nnz is None), "base_version and nnz come together (a delta needs both)")
    if nnz is not None:
        _require(isinstance(nnz, list) and len(nnz) == len(metas), "nnz must have one entry per tensor")
        for i, (k, m) in enumerate(zip(nnz, metas)):
            _require(_is_int(k) and -1 <= k <= _numel(m.shape),
                     f"nnz[{i}] must be -1 (dense) or a count of changed elements in 0..{_numel(m.shape)}")
    return UpdateRequest(body["version"], body["bucket_bytes"], metas, body.get("checksums", False), base,
                         nnz, body.get("keep_base", False))


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


def wire_parts(req: UpdateRequest) -> list[Part]:
    """What rank 0 broadcasts, in order: each tensor whole, or its delta's counts, offsets and values."""
    parts = []
    for i, meta in enumerate(req.tensors):
        numel, k = _numel(meta.shape), -1 if req.nnz is None else req.nnz[i]
        if k < 0:
            parts.append(Part(i, "dense", meta.dtype, numel))
        else:
            parts += [Part(i, "counts", "int32", -(-numel // BLOCK)), Part(i, "offsets", "int16", k),
                      Part(i, "values", meta.dtype, k)]
    return parts


def plan_buckets(items: list[Part] | list[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Greedy in-order packing of anything with `nbytes`; both sides call this, so they cut the stream at the
    same places."""
    buckets, indexes, offsets, used = [], [], [], 0
    for i, item in enumerate(items):
        start = -(-used // ALIGN_BYTES) * ALIGN_BYTES
        if indexes and start + item.nbytes > bucket_bytes:
            buckets.append(Bucket(indexes, offsets, used))
            indexes, offsets, start = [], [], 0
        indexes.append(i)
        offsets.append(start)
        used = start + item.nbytes
    if indexes:
        buckets.append(Bucket(indexes, offsets, used))
    return buckets


def tensor_checksum(t: torch.Tensor) -> int:
    """CRC32 of the tensor's bytes (debug option: catches corruption and ordering bugs)."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return zlib.crc32(memoryview(data))


