"""The weight-update contract between the trainer and the inference servers, both sides.

wire.py       the wire format (request bodies, bucket layout, checksums): what both sides agree on
collective.py the private process group both sides join, and deadline-bounded waits on it
publish.py    the trainer's published versions in host memory (rank 0): Publication
delivery.py   the thread that brings every announced server to the newest published version: Delivery
sender.py     one weight-update group and its rounds (rank 0): WeightBroadcaster, the transport Delivery drives
replies.py    the servers' pending HTTP replies of one round, beside the collective (rank 0)
deadline.py   how long forming the group and a round may take, and who was late (straggler isolation)
receiver.py   the server's side: receive_staged
shared.py     a tensor-parallel server's staging, received once and shared by its workers through /dev/shm
delta.py      delta updates: only the elements that changed (DeltaEncoder on the trainer, DeltaBase on a server)
"""

from pipelinerl.dtypes import dtype_name, torch_dtype
from pipelinerl.weights.collective import broadcast_async, open_group, wait_work
from pipelinerl.weights.delivery import Delivery, DeliveryFailed, DeliveryReport
from pipelinerl.weights.delta import Delta, DeltaBase, DeltaEncoder, changed_positions
from pipelinerl.weights.publish import Publication, PublishStats
from pipelinerl.weights.receiver import StagingBuffers, receive_staged
from pipelinerl.weights.sender import WeightBroadcaster, broadcast_address
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
    "Delivery",
    "DeliveryFailed",
    "DeliveryReport",
    "Delta",
    "DeltaBase",
    "DeltaEncoder",
    "InitRequest",
    "PublishStats",
    "Publication",
    "TensorMeta",
    "StagingBuffers",
    "UpdateRejected",
    "UpdateRequest",
    "WeightBroadcaster",
    "WeightTransferError",
    "broadcast_address",
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
