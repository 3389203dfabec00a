"""Server side of a weight update: receive the buckets into host memory and check their checksums."""

from __future__ import annotations

import torch

from pipelinerl.dtypes import torch_dtype
from pipelinerl.weights.collective import broadcast_async, wait_work
from pipelinerl.weights.wire import UpdateRequest, WeightTransferError, plan_buckets, tensor_checksum


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


