"""The vLLM glue's door: the plugin entry point, the version check, the engine-neutral update steps.

Fast (no server): the real plugin, vLLM registry and update state machine, with a recording engine in
place of vLLM's `AsyncLLM` for the state machine. The slow tests in test_inference_server.py run the
same code on a real vLLM server.
"""

import ast
import asyncio
import logging
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from pipelinerl.inference import vllm_glue
from pipelinerl.inference.updates import UpdateError, WeightUpdater

REPO = Path(__file__).resolve().parent.parent


def test_the_plugin_entry_point_is_installed_and_names_register():
    eps = {ep.name: ep.value for ep in entry_points(group=vllm_glue.PLUGIN_GROUP)}
    assert eps.get(vllm_glue.PLUGIN_NAME) == "pipelinerl.inference.vllm_glue:register"
    vllm_glue.check_plugin()


def test_vllm_loads_the_plugin_which_registers_the_engine_once():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.plugins import load_plugins_by_group

    from pipelinerl.inference.vllm_glue.transfer import StagedWeightEngine

    register = load_plugins_by_group(vllm_glue.PLUGIN_GROUP)[vllm_glue.PLUGIN_NAME]
    register()
    register()  # vLLM may load general plugins more than once per process
    assert WeightTransferEngineFactory._registry[vllm_glue.ENGINE_NAME]() is StagedWeightEngine


def test_only_vllm_0_32_is_accepted_and_the_error_names_both_versions(monkeypatch, caplog):
    monkeypatch.delenv(vllm_glue.OVERRIDE_ENV, raising=False)
    vllm_glue.check_version()  # the installed one
    for ok in ("0.32.0", "0.32.7", "0.32.1rc1.dev5+g1234.cpu"):
        vllm_glue.check_version(ok)
    for bad in ("0.33.0", "0.31.2", "1.32.0", "dev"):
        with pytest.raises(vllm_glue.VllmVersionError, match=rf"vLLM {bad} is installed.*written for vLLM 0\.32\.x"):
            vllm_glue.check_version(bad)
    monkeypatch.setenv(vllm_glue.OVERRIDE_ENV, "1")
    with caplog.at_level(logging.WARNING):
        vllm_glue.check_version("0.33.0")
    assert "vLLM 0.33.0 is installed" in caplog.text and vllm_glue.OVERRIDE_ENV in caplog.text


def test_nothing_outside_the_glue_imports_vllm():
    glue = REPO / "pipelinerl" / "inference" / "vllm_glue"
    offenders = []
    for path in (REPO / "pipelinerl").rglob("*.py"):
        if glue in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] == "vllm"]
    assert offenders == []


def test_per_token_versions_expand_the_spans():
    from pipelinerl.inference.vllm_glue.versions import per_token_versions

    spans = [SimpleNamespace(version="3", start=0, end=2), SimpleNamespace(version="4", start=2, end=5)]
    assert per_token_versions(SimpleNamespace(weight_versions=spans)) == [3, 3, 4, 4, 4]
    assert per_token_versions(SimpleNamespace(weight_versions=None)) is None


class RecordingEngine:
    """An `UpdatableEngine` that records the steps; `fail_receive` makes the receive raise."""

    num_ranks = 2

    def __init__(self, fail_receive: bool = False, fail_load: bool = False):
        self.calls: list[tuple] = []
        self.fail_receive, self.fail_load = fail_receive, fail_load

    def __getattr__(self, name):
        async def step(*args, **kwargs):
            self.calls.append((name, *args, *kwargs.values()))
            if name == "receive" and self.fail_receive:
                raise RuntimeError("peer vanished")
            if name == "load" and self.fail_load:
                raise RuntimeError("out of memory")
            return {"worker_timings": [{"receive_s": 0.1}] * 2, "in_group": False}.get(name)

        return step


INIT = {"master_addr": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3, "backend": "gloo",
        "timeout_s": 5.0}
EXPECTED = {"w": [2, 3]}
UPDATE = {"version": 7, "bucket_bytes": 1024, "tensors": [{"name": "w", "dtype": "float32", "shape": [2, 3]}]}


def test_the_updater_drives_the_engine_steps_in_order():
    engine = RecordingEngine()
    updater = WeightUpdater(engine, EXPECTED, "float32", "recompute", version=0, registry=CollectorRegistry())
    asyncio.run(updater.start())
    assert asyncio.run(updater.init_group(INIT))["ranks"] == [1, 2]
    reply = asyncio.run(updater.update(UPDATE))
    names = [c[0] for c in engine.calls]
    assert names == ["set_version", "join_group", "pause", "receive", "load", "resume", "worker_timings"]
    assert engine.calls[2] == ("pause", True) and engine.calls[4] == ("load", 7)
    assert reply["version"] == 7 and len(reply["workers"]) == 2
    assert updater.status()["version"] == 7 and updater.status()["num_ranks"] == 2


def test_a_failed_receive_resumes_on_the_old_weights():
    engine = RecordingEngine(fail_receive=True)
    updater = WeightUpdater(engine, EXPECTED, "float32", "keep", version=3, registry=CollectorRegistry())
    asyncio.run(updater.init_group(INIT))
    with pytest.raises(UpdateError, match="peer vanished") as err:
        asyncio.run(updater.update(UPDATE))
    assert err.value.status == 504
    assert [c[0] for c in engine.calls] == ["join_group", "pause", "receive", "in_group", "resume"]
    assert engine.calls[1] == ("pause", False)
    assert updater.status()["version"] == 3 and not updater.status()["group_ready"]


def test_a_failed_load_stops_the_server_instead_of_serving_a_half_loaded_model():
    engine, stops = RecordingEngine(fail_load=True), []
    updater = WeightUpdater(engine, EXPECTED, "float32", "keep", version=3, registry=CollectorRegistry(),
                            on_broken=lambda: stops.append(True))
    asyncio.run(updater.init_group(INIT))
    with pytest.raises(UpdateError, match="out of memory.*stops") as err:
        asyncio.run(updater.update(UPDATE))
    assert err.value.status == 500 and updater.broken and stops == [True]
    assert [c[0] for c in engine.calls] == ["join_group", "pause", "receive", "load"]  # never resumed
    assert updater.status()["version"] == 3 and not updater.status()["updating"]


def test_the_engine_spin_makes_an_idle_reader_look_at_its_queue_again_without_a_notification(monkeypatch):
    """inference.engine_spin_s (spin.py) on vLLM's real SpinCondition: a reader spins the set time, then sleeps on its
    notification socket at most RECHECK_MS at a time. Unpatched, a reader whose notification was lost and that has
    no deadline (timeout None) sleeps until one comes: here, never."""
    import threading

    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    from pipelinerl.inference.vllm_glue import spin

    original_wait = SpinCondition.wait
    monkeypatch.setattr(SpinCondition, "__init__", SpinCondition.__init__)  # put back after the test
    monkeypatch.setattr(SpinCondition, "wait", SpinCondition.wait)
    monkeypatch.setenv(spin.SPIN_ENV, "0.0")
    spin.apply_spin()
    spin.apply_spin()  # vLLM may load its plugins twice in one process: still one layer
    assert SpinCondition.wait.__wrapped__ is original_wait
    context = zmq.Context()
    writer = SpinCondition(False, context, "inproc://pipelinerl-spin-test")
    reader = SpinCondition(True, context, "inproc://pipelinerl-spin-test")
    assert reader.busy_loop_s == 0.0
    looked = threading.Event()
    threading.Thread(target=lambda: (reader.wait(None), looked.set()), daemon=True).start()
    assert looked.wait(60), "an idle reader without a notification never looked at its queue again"
    writer.notify()  # and a notification still wakes it
    reader.wait(None)
