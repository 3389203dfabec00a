"""The weight-update contract between the trainer and the inference servers, both sides.

wire.py       the wire format (request bodies, bucket layout, checksums): what both sides agree on
collective.py the private process group both sides join, and deadline-bounded waits on it
sender.py     the trainer's side (rank 0): WeightBroadcaster
receiver.py   the server's side: receive_staged
"""

from pipelinerl.dtypes import dtype_name, torch_dtype
from pipelinerl.weights.collective import broadcast_async, open_group, wait_work
from pipelinerl.weights.receiver import receive_staged
from pipelinerl.weights.sender import WeightBroadcaster
from pipelinerl.weights.wire import (
    ALIGN_BYTES,
    HTTP_MARGIN_S,
    Bucket,
    InitRequest,
    TensorMeta,
    UpdateRequest,
    WeightTransferError,
    parse_init_request,
    parse_update_request,
    plan_buckets,
    tensor_checksum,
    update_body,
)

__all__ = [
    "ALIGN_BYTES",
    "HTTP_MARGIN_S",
    "Bucket",
    "InitRequest",
    "TensorMeta",
    "UpdateRequest",
    "WeightBroadcaster",
    "WeightTransferError",
    "broadcast_async",
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
]
