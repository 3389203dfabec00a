"""Server side of a weight update: receive the buckets into staging (host or device memory) and check their
checksums."""

from __future__ import annotations

import torch

from pipelinerl.dtypes import torch_dtype
from pipelinerl.weights.collective import broadcast_async, wait_work
from pipelinerl.weights.wire import UpdateRequest, WeightTransferError, plan_buckets, tensor_checksum


def receive_staged(group, req: UpdateRequest, device: torch.device, deadline: float, peer: str,
                   staging: str = "host") -> list[tuple[str, torch.Tensor]]:
    """Server side: receive every bucket, return (name, tensor) pairs; nothing is loaded here, so a receive
    that fails part-way leaves the served model untouched (the caller drops the list).

    Each bucket lands on `device`. staging="host" copies it to host memory before the next bucket (pinned
    when `device` is a GPU, for the later host->device load): one bucket of device memory, the full model
    of host RAM. staging="device" keeps the buckets where they landed: no device->host->device round trip,
    but the full model in device memory. On CPU both are the same: the bucket buffers are the staging
    memory and the tensors are views into them (inference.update_staging).
    """
    assert staging in ("host", "device"), staging
    staged: list[tuple[str, torch.Tensor]] = []
    buckets = plan_buckets(req.tensors, req.bucket_bytes)
    for k, bucket in enumerate(buckets):
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        wait_work(broadcast_async(group, buf), deadline, f"bucket {k + 1}/{len(buckets)} from {peer}")
        if staging == "host" and buf.device.type != "cpu":
            host = torch.empty(bucket.nbytes, dtype=torch.uint8, pin_memory=True)
            buf = host.copy_(buf)
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


