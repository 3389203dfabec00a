"""A gate in vLLM's engine core for the tests that need an update to land mid-request by construction.

`serve()` (tests/test_inference_server.py) starts every test server with this folder on PYTHONPATH, so Python
imports this module at the start of each of the server's processes, and with PIPELINERL_TEST_ENGINE_GATE set
to a folder (EngineGate's, on the test's side). Two vLLM methods are wrapped as their modules are imported:
- the engine core's `EngineCore.step` first looks for the file `hold` in the folder: while it exists and names a
  number N, a step that finds at least N running requests, every one of which has generated a token, writes
  `held` and waits (at most HOLD_MAX_S) until `hold` is removed. The test sends an update meanwhile and removes
  `hold` once the server has claimed it: the engine runs the held step (its tokens are the old version's) and
  then reads the update's pause before any other step;
  After each step, a request that has its first token by then is appended to `started`: the order the engine
  started requests in, whatever the order their first chunks reach a client;
- the API server's `AsyncMPClient.add_request_async` appends a line to `added` once it has sent a request to the
  engine core: the test knows which requests are the engine's to schedule.
Without `hold` a step costs one failed open() and a look at the running requests.
"""

import importlib.abc
import os
import sys
import time

GATE = os.environ.get("PIPELINERL_TEST_ENGINE_GATE")
HOLD_MAX_S = 300.0  # a test that never opens the gate is failing anyway: the engine goes on


def _gate_step(core) -> None:
    step, hold, held = core.EngineCore.step, os.path.join(GATE, "hold"), os.path.join(GATE, "held")
    started, seen = os.path.join(GATE, "started"), set()

    def recorded_step(self):
        out = step(self)
        for r in self.scheduler.running:  # the order requests got their first token, as the engine made them
            if r.num_output_tokens > 0 and r.request_id not in seen:
                seen.add(r.request_id)
                with open(started, "a") as f:
                    f.write(f"{r.request_id}\n")
        return out

    def gated_step(self):
        try:
            with open(hold) as f:
                n = int(f.read())
        except (OSError, ValueError):
            return recorded_step(self)
        running = self.scheduler.running
        if len(running) >= n and all(r.num_output_tokens > 0 for r in running):
            open(held, "w").close()
            deadline = time.monotonic() + HOLD_MAX_S
            while os.path.exists(hold) and time.monotonic() < deadline:
                time.sleep(0.005)
        return recorded_step(self)

    core.EngineCore.step = gated_step


def _count_added(client) -> None:
    add, added = client.AsyncMPClient.add_request_async, os.path.join(GATE, "added")

    async def counted_add(self, request):
        await add(self, request)
        with open(added, "a") as f:
            f.write(f"{request.request_id}\n")

    client.AsyncMPClient.add_request_async = counted_add


PATCHES = {"vllm.v1.engine.core": _gate_step, "vllm.v1.engine.core_client": _count_added}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Applies PATCHES[name] when module `name` is first imported (not here: most processes import neither)."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_and_patch
        return spec


if GATE:
    sys.meta_path.insert(0, _PatchOnImport())
