"""The agent gateway (envs/agent_gateway.py, tasks/agent_task.py): an agent program on the real `openai` client
with a function tool (tests/agents/calculator_agent.py) trained as it is. Its chat completions are the turns of
one episode, token for token, sampled here by a scripted policy on the tiny tokenizer; its tool calls reach it as
OpenAI `tool_calls`; its return value (or posted reward) is the reward. Bad requests get their 4xx, and a
misbehaving agent ends only its own episode."""

import asyncio
from pathlib import Path

import httpx
import pytest
from test_envs_runner import ScriptedPolicy

from pipelinerl.config import ConfigError, TaskConfig
from pipelinerl.config.actor import AgentTaskConfig
from pipelinerl.envs.episode import EpisodeLimits
from pipelinerl.envs.runner import ENV_ERROR, run_episode
from pipelinerl.tasks import get_task
from pipelinerl.tiny_model import build_tokenizer

AGENTS = str(Path(__file__).parent / "agents")
LIMITS = EpisodeLimits(max_turns=4, max_tokens_per_turn=20, max_total_tokens=96)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _task(program="calculator_agent:agent", **fields):
    return get_task(TaskConfig(name="agent", agent=AgentTaskConfig(program=program, path=AGENTS,
                                                                   tool_format="compact", **fields)))


def _call(item) -> str:
    return "==" + item.prompt[:-1] + "="


def _run(task, item, policy, tok, timeout_s=30.0):
    """One episode of the task's agent, the gateway served for it on this event loop."""
    async def go():
        try:
            return await run_episode(policy, task.environment(item), tok, LIMITS, timeout_s)
        finally:
            await task.gateway.stop()
    return asyncio.run(go())


@pytest.fixture
def task():
    return _task()


def test_an_agents_requests_are_one_episode_token_for_token(task, tok):
    item = task.train_items[0]
    policy = ScriptedPolicy(tok, [_call(item), item.answer], versions=[2, 3])
    result = _run(task, item, policy, tok)
    assert (result.end_reason, result.error, result.reward) == ("finished", None, 1.0)
    assert (result.tool_calls, result.tool_errors) == (1, 0)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    eos = tok.eos_token_id
    # BOS prompt | call EOS | the agent's own calculator answer (its tool message) | answer EOS
    assert result.episode.token_ids == ([tok.bos_token_id] + enc(item.prompt) + enc(_call(item)) + [eos]
                                        + enc(item.answer) + enc(item.answer) + [eos])
    assert all(result.episode.token_ids[:len(p)] == p for p in policy.prefixes)
    wrong = _run(task, item, ScriptedPolicy(tok, ["1"], versions=[0]), tok)
    assert (wrong.end_reason, wrong.reward) == ("finished", 0.0)


def test_a_posted_reward_counts_when_the_agent_returns_none(tok):
    task = _task("calculator_agent:post_reward")
    result = _run(task, task.train_items[0], ScriptedPolicy(tok, ["12"], versions=[0]), tok)
    assert (result.end_reason, result.reward) == ("finished", 0.25)


@pytest.mark.parametrize("program, reason", [("calculator_agent:crash", "the agent failed on purpose"),
                                             ("calculator_agent:hang", "ran past task.agent.max_wall_s (5 s)")])
def test_an_agent_that_crashes_or_hangs_ends_only_its_episode(tok, program, reason):
    # the hanging agent is stopped by its own wall-clock bound, not by the runner's (60 s) step timeout
    task = _task(program, max_wall_s=5.0)
    result = _run(task, task.train_items[0], ScriptedPolicy(tok, ["12"], versions=[0]), tok, timeout_s=60.0)
    assert (result.end_reason, result.reward) == (ENV_ERROR, 0.0) and reason in result.error, result.error
    assert not task.gateway.episodes  # the key is gone with its episode


def test_bad_requests_get_their_4xx_and_touch_no_episode(task, tok):
    item = task.train_items[1]

    async def go():
        from pipelinerl.envs.agent_gateway import AgentEnv

        env = task.environment(item)
        assert isinstance(env, AgentEnv)
        await env.start()  # the agent's first request is parked: the episode's first turn is being sampled
        url, key = f"{task.gateway.url}/v1/chat/completions", env.key
        auth = {"Authorization": f"Bearer {key}"}
        body = {"model": "policy", "messages": [{"role": "user", "content": item.prompt}]}
        async with httpx.AsyncClient(timeout=10) as http:
            codes = {
                "no key": (await http.post(url, json=body)).status_code,
                "unknown key": (await http.post(url, json=body, headers={"Authorization": "Bearer pl-x"})).status_code,
                "malformed JSON": (await http.post(url, content=b"{not json", headers=auth)).status_code,
                "no messages": (await http.post(url, json={"model": "m"}, headers=auth)).status_code,
                "stream": (await http.post(url, json={**body, "stream": True}, headers=auth)).status_code,
                "second at once": (await http.post(url, json=body, headers=auth)).status_code,
                "bad reward": (await http.post(f"{task.gateway.url}/rl/reward", json={"reward": "high"},
                                               headers=auth)).status_code,
                "nested 10,000 deep": (await http.post(url, content=b"[" * 10_000 + b"]" * 10_000,
                                                       headers=auth)).status_code,
                "10 MB": (await http.post(url, content=b"{" + b" " * 10 * 2**20 + b"}", headers=auth)).status_code,
            }
            # the same client's connection still serves: the parked episode is still there, one request at a time
            codes["after"] = (await http.post(url, json=body, headers=auth)).status_code
            await env.close()
            codes["ended"] = (await http.post(url, json=body, headers=auth)).status_code
        await task.gateway.stop()
        return codes

    assert asyncio.run(go()) == {"no key": 401, "unknown key": 401, "malformed JSON": 400, "no messages": 400,
                                 "stream": 400, "second at once": 429, "bad reward": 400, "nested 10,000 deep": 400,
                                 "10 MB": 413, "after": 429, "ended": 401}


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="task.agent.program"):
        TaskConfig(name="agent")
    with pytest.raises(ConfigError, match="module:function"):
        AgentTaskConfig(program="no_colon")
