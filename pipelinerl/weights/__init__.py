"""The weight-update contract between the trainer and the inference servers, both sides.

wire.py       the wire format (request bodies, bucket layout, checksums): what both sides agree on
collective.py the private process group both sides join, and deadline-bounded waits on it
sender.py     the trainer's side (rank 0): WeightBroadcaster
receiver.py   the server's side: receive_staged
shared.py     a tensor-parallel server's staging, received once and shared by its workers through /dev/shm
delta.py      delta updates: only the elements that changed (DeltaEncoder on the trainer, DeltaBase on a server)
"""

from pipelinerl.dtypes import dtype_name, torch_dtype
from pipelinerl.weights.collective import broadcast_async, open_group, wait_work
from pipelinerl.weights.delta import Delta, DeltaBase, DeltaEncoder, changed_positions
from pipelinerl.weights.receiver import StagingBuffers, receive_staged
from pipelinerl.weights.sender import WeightBroadcaster
from pipelinerl.weights.wire import (
    ALIGN_BYTES,
    HTTP_MARGIN_S,
    Bucket,
    InitRequest,
    TensorMeta,
    UpdateRejected,
    UpdateRequest,
    WeightTransferError,
    parse_init_request,
    parse_update_request,
    plan_buckets,
    tensor_checksum,
    update_body,
    wire_parts,
)

__all__ = [
    "ALIGN_BYTES",
    "HTTP_MARGIN_S",
    "Bucket",
    "Delta",
    "DeltaBase",
    "DeltaEncoder",
    "InitRequest",
    "TensorMeta",
    "StagingBuffers",
    "UpdateRejected",
    "UpdateRequest",
    "WeightBroadcaster",
    "WeightTransferError",
    "broadcast_async",
    "changed_positions",
    "dtype_name",
    "open_group",
    "parse_init_request",
    "parse_update_request",
    "plan_buckets",
    "receive_staged",
    "tensor_checksum",
    "torch_dtype",
    "update_body",
    "wait_work",
    "wire_parts",
]
