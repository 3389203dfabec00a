"""An OpenEnv environment server (openenv-core's own server, tests/openenv_envs/openenv_tiny_sums.py, run by uvicorn
as OpenEnv runs one) played as our episodes (tasks/openenv_task.py, envs/openenv_env.py) by a scripted policy on
the tiny tokenizer: each episode one WebSocket session, token for token; the reset seed is the item; a server
that dies mid-episode ends only the episodes it held (environment errors), and a restarted one serves again."""

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_envs_runner import ScriptedPolicy

from pipelinerl.config import ConfigError, TaskConfig
from pipelinerl.config.actor import OpenEnvConfig
from pipelinerl.envs.episode import EpisodeLimits
from pipelinerl.envs.runner import ENV_ERROR, run_episode
from pipelinerl.tasks import get_task
from pipelinerl.tiny.model import build_tokenizer

ENVS = Path(__file__).parent / "openenv_envs"
LIMITS = EpisodeLimits(max_turns=4, max_tokens_per_turn=20, max_total_tokens=96)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m uvicorn openenv_tiny_sums:app` on a free port, until stop(); start() waits for /health."""

    def __init__(self):
        self.port, self.proc = _free_port(), None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "openenv_tiny_sums:app", "--host", "127.0.0.1",
                                      "--port", str(self.port), "--ws", "websockets"], cwd=ENVS,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the OpenEnv server exited"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        raise TimeoutError("the OpenEnv server did not answer /health in 120 s")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def server():
    s = Server()
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _task(server, **fields):
    return get_task(TaskConfig(name="openenv", openenv=OpenEnvConfig(
        url=server.url, observation_fields=["prompt", "tool_result"], num_items=100, num_eval_items=10,
        eval_seed_start=1000, **fields)))


def _call(prompt: str) -> str:
    return "==" + prompt[:-1] + "="


async def _first_prompt(task, item) -> str:
    env = task.environment(item)
    try:
        await env.start()
        return env.messages()[0]["content"]
    finally:
        await env.close()


def test_items_are_seeds_and_a_seed_draws_the_same_problem(server):
    task = _task(server)
    assert [i.id for i in task.train_items[:2]] == ["seed-0", "seed-1"] and task.eval_items[0].id == "seed-1000"
    first = asyncio.run(_first_prompt(task, task.train_items[0]))
    again = asyncio.run(_first_prompt(task, task.train_items[0]))
    other = asyncio.run(_first_prompt(task, task.train_items[1]))
    assert first == again != other and first.endswith("=")


def test_an_episode_is_one_session_token_for_token(server, tok):
    task = _task(server)
    item = task.train_items[3]
    prompt = asyncio.run(_first_prompt(task, item))
    answer = str(sum(map(int, prompt[:-1].split("+"))))
    policy = ScriptedPolicy(tok, [_call(prompt), answer], versions=[4, 5])
    result = asyncio.run(run_episode(policy, task.environment(item), tok, LIMITS, 30.0))
    assert (result.end_reason, result.error, result.reward) == ("finished", None, 1.0)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    eos = tok.eos_token_id
    assert result.episode.token_ids == ([tok.bos_token_id] + enc(prompt) + enc(_call(prompt)) + [eos] + enc(answer)
                                        + enc(answer) + [eos])
    wrong = asyncio.run(run_episode(ScriptedPolicy(tok, ["1"], versions=[0]), task.environment(item), tok, LIMITS,
                                    30.0))
    assert (wrong.end_reason, wrong.reward) == ("finished", 0.0)


def test_a_server_that_dies_mid_episode_ends_only_its_episodes(tok):
    server = Server()
    server.start()
    try:
        task = _task(server)
        items = task.train_items[:4]
        gate, arrived = asyncio.Event(), []

        class Gated(ScriptedPolicy):
            async def __call__(self, prefix, max_tokens):
                if len(self.prefixes) == 1:  # after the first step's tool answer: wait for the kill
                    arrived.append(self)
                    await gate.wait()
                return await super().__call__(prefix, max_tokens)

        async def episode(item):
            prompt = await _first_prompt(task, item)
            return await run_episode(Gated(tok, [_call(prompt), "1"], versions=[0, 0]), task.environment(item), tok,
                                     LIMITS, 30.0)

        async def scenario():
            runs = [asyncio.create_task(episode(i)) for i in items]
            deadline = time.monotonic() + 60
            while len(arrived) < len(items) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert len(arrived) == len(items), "every episode holds a session at its second turn"
            server.stop()
            gate.set()
            return await asyncio.gather(*runs)

        results = asyncio.run(scenario())
        assert [r.end_reason for r in results] == [ENV_ERROR] * len(items)
        assert all(r.error.startswith("step() raised") for r in results), [r.error for r in results]
        assert all(len(r.episode.model_turns) == 2 for r in results)
        server.start()  # restarted on the same port: new sessions are served
        assert asyncio.run(_first_prompt(task, items[0])).endswith("=")
    finally:
        if server.proc.poll() is None:
            server.stop()


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="task.openenv.url"):
        TaskConfig(name="openenv")
    with pytest.raises(ConfigError, match="eval_seed_start"):
        OpenEnvConfig(url="http://x", num_items=10, eval_seed_start=5)
