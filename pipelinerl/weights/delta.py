"""Delta weight updates (trainer.broadcast_delta): send only the elements that changed, losslessly.

At RL learning rates most 16-bit weights are bit-identical from one optimizer step to the next (an Adam
step of ~1e-6 is below half the bf16 spacing, |w|/256, of most weights), so a tensor's delta -- where its
changed elements are and their new values -- is a few percent of the tensor. Positions go as 16-bit offsets
inside blocks of 65536 elements plus one int32 count per block (wire.BLOCK), so a changed bf16 element
costs 4 bytes where a dense one costs 2. Exact by construction:

- elements are compared bit by bit (as integers), so every change is sent, -0.0 and NaN payloads included;
- a delta applies only to the version it was computed from (UpdateRequest.base_version): the trainer sends
  deltas only when every server reports that version as its base, and a server refuses any other;
- a tensor whose delta would not be smaller is sent dense.

DeltaEncoder (trainer rank 0) keeps the weights of the last broadcast; DeltaBase (each server worker) keeps
the same weights, applies a delta to them and hands the full tensors to the load. Both in host memory: one
copy of the model each (on a server, in its receiving worker; with tensor parallelism in the /dev/shm staging
that its other workers load from, weights/shared.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipelinerl.weights.wire import (
    BLOCK,
    TensorMeta,
    UpdateRejected,
    UpdateRequest,
    itemsize,
    tensor_checksum,
)

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Delta:
    """A tensor's change: new `values` at the positions `counts` and `offsets` encode (encode_positions)."""

    counts: torch.Tensor  # int32: changed elements per block of BLOCK elements
    offsets: torch.Tensor  # int16: each changed element's offset in its block (as 16 unsigned bits), in order
    values: torch.Tensor

    def positions(self) -> torch.Tensor:
        """The flat positions, in order: int32 below 2**31 elements (cheaper on CPU), else int64."""
        dtype = torch.int32 if self.counts.numel() * BLOCK < 2**31 else torch.int64
        blocks = torch.repeat_interleave(torch.arange(self.counts.numel(), dtype=dtype, device=self.counts.device),
                                         self.counts)
        return (blocks << 16) | (self.offsets.to(dtype) & 0xFFFF)


def encode_positions(positions: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted flat positions (int64) -> (per-block counts int32, in-block offsets as 16 bits in an int16)."""
    counts = torch.bincount(positions >> 16, minlength=-(-numel // BLOCK)).to(torch.int32)
    return counts, (positions & 0xFFFF).to(torch.int32).to(torch.int16)  # 32768.. wrap to negatives


def changed_positions(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat positions (int64) where `new` differs bit-wise from `old`: same shape, dtype and device."""
    view = _INT_VIEW[new.element_size()]
    return (old.reshape(-1).view(view) != new.reshape(-1).view(view)).nonzero().squeeze(1)


def delta_nbytes(meta: TensorMeta, changed: int) -> int:
    """Wire bytes of a delta of `changed` elements of the tensor `meta` describes."""
    numel = meta.nbytes // itemsize(meta.dtype)
    return 4 * -(-numel // BLOCK) + changed * (2 + itemsize(meta.dtype))


class DeltaEncoder:
    """Trainer side: the weights of the last broadcast, and the per-tensor choice of dense or delta.

    `version` is the version the base holds once every server confirmed it; the caller sets it after a
    successful round and clears it after a failed one (the base then holds weights no server may have).
    """

    def __init__(self, pin: bool = False) -> None:
        """`pin`: the base in page-locked memory (a GPU sender packs its dense tensors into device buckets)."""
        self.base: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self.pin = pin

    def encode(self, meta: TensorMeta, t: torch.Tensor, delta: bool) -> tuple[torch.Tensor | Delta, int]:
        """What to send for `t`: the base's updated copy (dense) or a Delta, and the number of changed
        elements (-1 when not compared). The base takes the new weights either way."""
        base = self.base.get(meta.name)
        if base is None or base.shape != t.shape or base.dtype != t.dtype:
            base = self.base[meta.name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin or t.is_cuda)
            delta = False
        changed = -1
        if delta:
            positions = changed_positions(base.to(t.device, non_blocking=True), t)
            changed = positions.numel()
            if delta_nbytes(meta, changed) < meta.nbytes:
                values = t.reshape(-1)[positions]
                base.view(-1)[positions.cpu()] = values.cpu()
                return Delta(*encode_positions(positions, t.numel()), values), changed
        base.copy_(t)
        return base, changed


class DeltaBase:
    """Server side, one per receiving worker: the weights of `version` that deltas apply to (host memory)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None

    def drop(self) -> None:
        self.tensors, self.version = {}, None

    def resolve(self, req: UpdateRequest, staged: list[tuple[str, torch.Tensor | Delta]], sums: list[int] | None,
                peer: str) -> list[tuple[str, torch.Tensor]]:
        """The update's full tensors: each delta applied to the base (in place), each checked against its
        CRC32 in `sums` when given. The base then holds `req.version` if the request keeps it; it is dropped
        otherwise, and on UpdateRejected (a CRC differs, or the deltas are against another base): the next
        update must be dense."""
        try:
            if req.base_version is not None and req.base_version != self.version:
                raise UpdateRejected(f"the update from {peer} is a delta against version {req.base_version}, "
                                     f"but this server's delta base is {self.version}")
            full = [(name, self._apply(name, x)) for name, x in staged]
            if sums is not None:
                bad = [name for (name, t), s in zip(full, sums) if tensor_checksum(t) != s]
                if bad:
                    raise UpdateRejected(f"checksum mismatch on {len(bad)} tensor(s) from {peer}: {bad[:5]}")
        except BaseException:
            self.drop()
            raise
        if req.keep_base:
            self.tensors.update((name, self._host_copy(name, t)) for name, t in full)
            if any(t.is_cuda for _, t in full):
                torch.cuda.synchronize()  # the device->host copies have landed before the base is used
            self.version = req.version
        else:
            self.drop()
        return full

    def _host_copy(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """`t` as the base keeps it: a host tensor as it is (a view into host staging, which the caller then
        lets go: StagingBuffers.release); a device tensor (device staging) copied into the base's own pinned
        tensor of that name, allocated once and reused by later updates (asynchronously: resolve synchronizes)."""
        if t.device.type == "cpu":
            return t
        kept = self.tensors.get(name)
        if kept is None or kept.shape != t.shape or kept.dtype != t.dtype or not kept.is_pinned():
            kept = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return kept.copy_(t, non_blocking=True)

    def _apply(self, name: str, x: torch.Tensor | Delta) -> torch.Tensor:
        if not isinstance(x, Delta):
            return x
        base = self.tensors[name]
        base.view(-1)[x.positions().cpu()] = x.values.cpu()
        return base
