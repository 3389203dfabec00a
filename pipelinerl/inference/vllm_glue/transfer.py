"""Worker side of the weight updates: a vLLM weight-transfer engine that stages, then loads.

Runs inside vLLM's worker processes: the plugin (`register` in __init__.py) puts the engine in vLLM's
registry there; `--worker-extension-cls` mixes `WorkerExtension` into the worker.

vLLM's own `nccl` engine loads each tensor as it arrives, inside a layerwise reload that first moves the
layers to the meta device: a trainer that dies mid-broadcast leaves a model on meta and the next step
kills the engine (FACTS.md). This engine keeps vLLM's lifecycle (`start_weight_update` ->
`update_weights` -> `finish_weight_update`, driven by `AsyncLLM`) but splits it differently:

- `update_weights` only receives, into staging buffers, with a deadline; on any failure the staging is
  dropped and the model was never touched. The server's `inference.update_staging` picks where the
  staging lives on a GPU (host RAM, or device memory: no device->host->device copies); it comes with
  the init info (`GroupInitInfo.staging`, added by the server, not by the trainer).
- `finish_weight_update` loads from staging with vLLM's layerwise reload, which re-runs the weight
  post-processing. On CPU that re-packs the oneDNN linear weights, so the load is exact and inference
  keeps the prepacked kernels (no throughput cost; the alternative, plain `F.linear`, costs 15-30 %).

One engine serves both transports: `backend` in the init info picks gloo (CPU) or NCCL (GPU); with
tensor parallelism each worker is a rank of its own and receives full tensors, which `load_weights`
shards as it does for a checkpoint.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from pipelinerl.inference.vllm_glue import ENGINE_NAME
from pipelinerl.weights import (
    DeltaBase,
    InitRequest,
    StagingBuffers,
    UpdateRejected,
    open_group,
    parse_update_request,
    receive_staged,
)


@dataclass
class GroupInitInfo(WeightTransferInitInfo):
    master_addr: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str
    timeout_s: float
    group: str = "weights"
    staging: str = "host"  # the server's inference.update_staging (control.VllmEngine.join_group adds it)


@dataclass
class StagedUpdateInfo(WeightTransferUpdateInfo):
    version: int
    bucket_bytes: int
    tensors: list = field(default_factory=list)
    checksums: bool = False
    base_version: int | None = None
    nnz: list | None = None
    keep_base: bool = False


class StagedWeightEngine(WeightTransferEngine[GroupInitInfo, StagedUpdateInfo]):
    init_info_cls = GroupInitInfo
    update_info_cls = StagedUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.request: InitRequest | None = None
        self.staging = "host"
        self.staged: list[tuple[str, torch.Tensor]] | None = None
        self.base = DeltaBase()  # the weights delta updates apply to (weights/delta.py), when the trainer sends them
        self.buffers = StagingBuffers()  # where the buckets land, kept from one update to the next
        self.timings: dict[str, float] = {}

    @property
    def peer(self) -> str:
        assert self.request is not None
        return f"the trainer at {self.request.master_addr}:{self.request.master_port}"

    def init_transfer_engine(self, init_info: GroupInitInfo) -> None:
        """Join the trainer's new group; only once that succeeded, leave the old one (a trainer that re-forms
        the group, or a restarted trainer: the old one is then dead). A failed join keeps the old group."""
        fields = asdict(init_info)
        staging = fields.pop("staging")
        request = InitRequest(**fields)
        pc = self.parallel_config
        # gloo's threads get the server's cores, not only the compute cores vLLM bound this worker to: the
        # worker's parent, vLLM's engine core, keeps the server's (the launcher's launch.inference_cpus)
        cpus = os.sched_getaffinity(os.getppid()) if request.backend == "gloo" else None
        group = open_group(request, request.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank,
                           cpus=cpus)
        self.shutdown()
        self.group, self.request, self.staging = group, request, staging

    def start_weight_update(self) -> None:
        self.staged = None  # the model stays untouched until every byte has arrived

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU torch; the
        # receive below already waits for each collective to complete.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: StagedUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("no weight-update group: POST /init_process_group first")
        req = parse_update_request(asdict(update_info))
        device = torch.device("cpu") if self.request.backend == "gloo" else self.device
        started = time.monotonic()
        try:
            self.staged = receive_staged(self.group, req, device, started + self.request.timeout_s, self.peer,
                                         self.staging, self.base, self.buffers)
        except UpdateRejected:
            self.staged = None  # every collective completed: the group stays usable, the base is dropped
            raise
        except BaseException:
            # A collective that failed half-way leaves the group unusable: the trainer must re-init.
            self.staged = None
            self.base.drop()
            self.buffers.forget()  # a collective that gave up may still write into them
            self.shutdown()
            raise
        if req.keep_base:
            self.buffers.forget()  # the base holds views into them
        self.timings = {"receive_s": time.monotonic() - started}

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        assert self.staged is not None, "finish_weight_update without a completed receive"
        started = time.monotonic()
        with torch.no_grad(), disable_mtp_completeness_check():
            initialize_layerwise_reload(self.model)
            self.model.load_weights(iter(self.staged))
            finalize_layerwise_reload(self.model, self.model_config)
        self.staged = None
        self.timings["load_s"] = time.monotonic() - started

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None


def register_engine() -> None:
    """Make the engine known to vLLM in this process; a second call does nothing (vLLM's
    `register_engine` raises on a duplicate name, and the plugin may load more than once)."""
    if ENGINE_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, StagedWeightEngine)


class WorkerExtension:
    """Mixed into vLLM's worker (`--worker-extension-cls`); methods are called with `collective_rpc`."""

    def pipelinerl_update_timings(self) -> dict[str, float]:
        return dict(self.weight_transfer_engine.timings)

    def pipelinerl_has_group(self) -> bool:
        return self.weight_transfer_engine.group is not None
