"""The agent gateway (envs/agent_gateway.py, tasks/agent_task.py): agent programs on the real `openai` client and
on the OpenAI Agents SDK, with a function tool (tests/agent_programs/), trained as they are. Their chat completions
are the turns of one episode, token for token, sampled here by a scripted policy on the tiny tokenizer; tool calls
reach them as OpenAI `tool_calls`; the return value (or posted reward) is the reward. A request that goes back in
the conversation branches the episode, its cut-off tokens counted and never trained. Bad requests get their 4xx,
and a misbehaving agent ends only its own episode."""

import asyncio
import sys
from pathlib import Path

import httpx
import pytest
from test_envs_runner import ScriptedPolicy

from pipelinerl.actor.episodes import EpisodeStats, episode_rollout
from pipelinerl.config import ConfigError, TaskConfig
from pipelinerl.config.actor import AgentTaskConfig
from pipelinerl.envs.episode import EpisodeLimits
from pipelinerl.envs.runner import ENV_ERROR, run_episode
from pipelinerl.tasks import get_task
from pipelinerl.tiny.model import build_tokenizer

AGENTS = str(Path(__file__).parent / "agent_programs")
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


@pytest.mark.parametrize("program", ["sdk_agent:agent", "sdk_agent:streamed"])
def test_an_openai_agents_sdk_agent_runs_its_function_tool_on_the_turns_of_one_episode(tok, program):
    """tests/agent_programs/sdk_agent.py: an `agents.Agent` with a `function_tool`, run by `Runner.run`, and by
    `Runner.run_streamed` (stream=true requests, answered as server-sent chunks)."""
    task = _task(program)
    item = task.train_items[0]
    policy = ScriptedPolicy(tok, [_call(item), item.answer], versions=[0, 1])
    result = _run(task, item, policy, tok)
    assert (result.end_reason, result.error, result.reward, result.drift_tokens) == ("finished", None, 1.0, 0)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    eos = tok.eos_token_id
    # the SDK ran the calculator tool on the parsed call and sent its output as the tool message
    assert result.episode.token_ids == ([tok.bos_token_id] + enc(item.prompt) + enc(_call(item)) + [eos]
                                        + enc(item.answer) + enc(item.answer) + [eos])
    assert all(result.episode.token_ids[:len(p)] == p for p in policy.prefixes)


def _command_task(*flags, **fields):
    cli = [sys.executable, str(Path(AGENTS) / "calculator_cli.py"), *flags]
    return get_task(TaskConfig(name="agent", agent=AgentTaskConfig(command=cli, tool_format="compact", **fields)))


def _running(flag: str) -> bool:
    """Whether a calculator_cli.py process with `flag` is alive (its /proc cmdline)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"calculator_cli.py") for a in argv) and flag.encode() in argv:
            return True
    return False


def test_a_command_line_agent_is_a_process_per_episode_on_the_standard_openai_variables(tok):
    task = _command_task()
    item = task.train_items[0]
    policy = ScriptedPolicy(tok, [_call(item), item.answer], versions=[0, 1])
    result = _run(task, item, policy, tok)
    assert (result.end_reason, result.error, result.reward) == ("finished", None, 1.0)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    eos = tok.eos_token_id
    assert result.episode.token_ids == ([tok.bos_token_id] + enc(item.prompt) + enc(_call(item)) + [eos]
                                        + enc(item.answer) + enc(item.answer) + [eos])
    failed = _run(task := _command_task("--fail"), task.train_items[0], ScriptedPolicy(tok, ["12"], [0]), tok)
    assert failed.end_reason == ENV_ERROR and "exited with code 1: failed on purpose" in failed.error, failed.error
    hung = _run(task := _command_task("--hang", max_wall_s=5.0), task.train_items[0],
                ScriptedPolicy(tok, ["12"], [0]), tok, timeout_s=60.0)
    assert hung.end_reason == ENV_ERROR and "max_wall_s" in hung.error, hung.error
    assert not _running("--hang")  # killed with its process group


def test_a_posted_reward_counts_when_the_agent_returns_none_and_the_tasks_check_when_it_posts_none(tok):
    task = _task("calculator_agent:post_reward")
    result = _run(task, task.train_items[0], ScriptedPolicy(tok, ["12"], versions=[0]), tok)
    assert (result.end_reason, result.reward) == ("finished", 0.25)
    task = _task("calculator_agent:no_reward")
    item = task.train_items[0]
    right = _run(task, item, ScriptedPolicy(tok, [item.answer], versions=[0]), tok)
    wrong = _run(task, item, ScriptedPolicy(tok, ["12"], versions=[0]), tok)
    assert (right.end_reason, right.reward, wrong.reward) == ("finished", 1.0, 0.0)


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
                "stream": (await http.post(url, json={**body, "stream": "yes"}, headers=auth)).status_code,
                "second at once": (await http.post(url, json=body, headers=auth)).status_code,
                "bad reward": (await http.post(f"{task.gateway.url}/rl/reward", json={"reward": "high"},
                                               headers=auth)).status_code,
                "nested 10,000 deep": (await http.post(url, content=b"[" * 10_000 + b"]" * 10_000,
                                                       headers=auth)).status_code,
                "10 MB": (await http.post(url, content=b"{" + b" " * 10 * 2**20 + b"}", headers=auth)).status_code,
                "n=2": (await http.post(url, json={**body, "n": 2}, headers=auth)).status_code,
                "stop": (await http.post(url, json={**body, "stop": [3]}, headers=auth)).status_code,
                "text completions": (await http.post(f"{task.gateway.url}/v1/completions", json={"prompt": "1+2="},
                                                     headers=auth)).status_code,
            }
            # the same client's connection still serves: the parked episode is still there, one request at a time
            codes["after"] = (await http.post(url, json=body, headers=auth)).status_code
            await env.close()
            codes["ended"] = (await http.post(url, json=body, headers=auth)).status_code
        await task.gateway.stop()
        return codes

    assert asyncio.run(go()) == {"no key": 401, "unknown key": 401, "malformed JSON": 400, "no messages": 400,
                                 "stream": 400, "second at once": 429, "bad reward": 400, "nested 10,000 deep": 400,
                                 "10 MB": 413, "n=2": 400, "stop": 400, "text completions": 400, "after": 429,
                                 "ended": 401}


def test_a_text_completions_agent_is_one_episode_of_its_own_text_token_for_token(tok):
    """tests/agent_programs/text_agent.py on `completions.create` with a stop string: the episode is the text it
    writes, no chat template (its prompt tokenised as a server tokenises text: BOS first). The turn that asks for
    the calculator ends at the stop string the server stopped at; the agent got it left out and wrote it back, so
    its next prompt continues the exact tokens. The stop string reached every server call."""
    task = _task("text_agent:agent")
    item = task.train_items[0]
    expression = item.prompt[:-1]
    policy = ScriptedPolicy(tok, [expression + "*", item.answer], versions=[0, 1])
    result = _run(task, item, policy, tok)
    assert (result.end_reason, result.error, result.reward, result.drift_tokens) == ("finished", None, 1.0, 0)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    # BOS prompt | sum * (stopped: no EOS) | the agent's value and "=" | answer EOS
    assert result.episode.token_ids == ([tok.bos_token_id] + enc(item.prompt) + enc(expression + "*")
                                        + enc(item.answer + "=") + enc(item.answer) + [tok.eos_token_id])
    assert all(result.episode.token_ids[:len(p)] == p for p in policy.prefixes)
    assert policy.stops == [("*",), ("*",)]
    assert [t.kind for t in result.episode.turns] == ["prompt", "model", "env", "model"]


def test_a_text_agent_that_drops_the_models_text_restarts_from_its_own_and_the_cut_turn_is_drift(tok):
    task = _task("text_agent:rewrites")
    item = task.train_items[0]
    first = item.prompt[:-1] + "*"
    result = _run(task, item, ScriptedPolicy(tok, [first, "3"], versions=[0, 1]), tok)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert (result.end_reason, result.error, result.reward) == ("finished", None, 1.0)
    assert result.drift_tokens == len(enc(first))
    assert result.episode.token_ids == [tok.bos_token_id] + enc(item.prompt + "1+2*3=") + enc("3") + [tok.eos_token_id]
    assert result.episode.prompt_length == 1 + len(enc(item.prompt + "1+2*3="))


def test_bad_text_completion_requests_get_400(tok):
    task = _task("text_agent:agent")
    item = task.train_items[1]

    async def go():
        env = task.environment(item)
        await env.start()  # the agent's first text request is parked
        url, auth = f"{task.gateway.url}/v1/completions", {"Authorization": f"Bearer {env.key}"}
        async with httpx.AsyncClient(timeout=10) as http:
            codes = {name: (await http.post(url, json=body, headers=auth)).status_code for name, body in {
                "no prompt": {"model": "m"}, "empty prompt": {"prompt": ""}, "two prompts": {"prompt": ["1", "2"]},
                "token ids": {"prompt": [1, 2, 3]}, "echo": {"prompt": "1", "echo": True},
                "suffix": {"prompt": "1", "suffix": "2"}, "n=3": {"prompt": "1", "n": 3},
                "empty stop": {"prompt": "1", "stop": ""}, "one prompt": {"prompt": ["1"]}}.items()}
            codes["chat"] = (await http.post(f"{task.gateway.url}/v1/chat/completions", headers=auth, json={
                "messages": [{"role": "user", "content": "1"}]})).status_code
            await env.close()
        await task.gateway.stop()
        return codes

    assert asyncio.run(go()) == {"no prompt": 400, "empty prompt": 400, "two prompts": 400, "token ids": 400,
                                 "echo": 400, "suffix": 400, "n=3": 400, "empty stop": 400, "one prompt": 429,
                                 "chat": 400}


class HeldPolicy(ScriptedPolicy):
    """A ScriptedPolicy whose first turn is sampled only once `hold()` is true (a bounded wait)."""

    def __init__(self, tok, texts, hold):
        super().__init__(tok, texts, versions=list(range(len(texts))))
        self.hold = hold

    async def __call__(self, prefix, max_tokens):
        for _ in range(6000):
            if self.prefixes or self.hold():
                return await super().__call__(prefix, max_tokens)
            await asyncio.sleep(0.01)
        raise AssertionError("the first turn's condition never held")


def _branched(program, tok, texts, hold=None):
    """One episode of a calculator agent that goes back in its conversation; (result, policy, item)."""
    task = _task(f"calculator_agent:{program}")
    item = task.train_items[2]

    async def go():
        env = task.environment(item)
        policy = HeldPolicy(tok, texts, hold(env)) if hold else ScriptedPolicy(tok, texts, list(range(len(texts))))
        try:
            return await run_episode(policy, env, tok, LIMITS, 30.0), policy
        finally:
            await task.gateway.stop()
    return (*asyncio.run(go()), item)


@pytest.mark.parametrize("program", ["retry_turn", "gives_up"])
def test_a_retried_turn_is_sampled_again_and_only_the_answer_the_agent_read_is_trained(tok, program):
    """retry_turn asks its first turn twice and reads both answers; gives_up times out on its first request
    (held until its retry has replaced it at the gateway), so that first answer reaches nobody. Either way the
    row is the conversation the agent went on with, and the first answer's tokens are drift."""
    hold = (lambda env: lambda: not env.calls.empty()) if program == "gives_up" else None
    item = _task().train_items[2]
    texts = ["==1=", _call(item), item.answer]
    result, policy, item = _branched(program, tok, texts, hold)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    eos = tok.eos_token_id
    assert (result.end_reason, result.error, result.reward) == ("finished", None, 1.0)
    assert result.episode.token_ids == ([tok.bos_token_id] + enc(item.prompt) + enc(_call(item)) + [eos]
                                        + enc(item.answer) + enc(item.answer) + [eos])
    assert result.drift_tokens == len(enc("==1=")) + 1 and result.episode.sampled_turns == 3
    assert policy.prefixes[1] == policy.prefixes[0]  # the retry continued the very prompt of the first try
    assert sum(result.episode.loss_mask) == len(enc(_call(item))) + len(enc(item.answer)) + 2
    assert [v for v, m in zip(result.episode.versions, result.episode.loss_mask) if m] == (
        [1] * (len(enc(_call(item))) + 1) + [2] * (len(enc(item.answer)) + 1))


@pytest.mark.parametrize("program", ["edit_reply", "summarise"])
def test_an_agent_that_rewrites_its_history_starts_a_branch_with_the_rewrite_rendered_untrained(tok, program):
    """edit_reply sends our tool-call turn back as its own text and the result as a user message; summarise
    starts over from one message with the result. The rewritten conversation is the row's prompt (loss mask 0)
    and the cut-off call turn is drift."""
    item = _task().train_items[2]
    result, _, item = _branched(program, tok, [_call(item), item.answer])
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    a, b, c = map(int, item.prompt[:-1].split("+"))
    opening = item.prompt + ("==" if program == "edit_reply" else "") + str(a + b + c)
    assert (result.end_reason, result.reward, result.drift_tokens) == ("finished", 1.0, len(enc(_call(item))) + 1)
    ep = result.episode
    assert ep.token_ids == [tok.bos_token_id] + enc(opening) + enc(item.answer) + [tok.eos_token_id]
    assert ep.prompt_length == 1 + len(enc(opening)) and len(ep.model_turns) == 1


def test_an_answer_the_agent_never_read_at_its_end_is_kept_untrained_and_counted(tok):
    item = _task().train_items[2]
    result, _, item = _branched("gives_up_last", tok, [item.answer], hold=lambda env: lambda: bool(
        env.inflight and env.inflight()))
    n = len(tok.encode(item.answer, add_special_tokens=False)) + 1
    assert (result.end_reason, result.reward, result.drift_tokens) == ("finished", 0.0, n)
    assert len(result.episode.model_turns) == 1 and sum(result.episode.loss_mask) == 0
    stats = EpisodeStats()
    stats.add([result])
    assert stats.scalars()["actor/agent_drift_tokens"] == n
    row = episode_rollout("run", "g", 0, item, result, "agent", "actor0", {})
    assert row.metadata["drift_tokens"] == n and sum(row.loss_mask) == 0


def test_where_a_call_continues_the_conversation():
    """ChatProgramEnv.place: the calls a program made so far and the answers it got, then a new call's messages."""
    from pipelinerl.envs.agent_gateway import AgentEnv
    from pipelinerl.envs.chat_program import Answered, ModelCall
    from pipelinerl.envs.tool_calls import call_format

    user, tool = {"role": "user", "content": "1+2+3="}, {"role": "tool", "tool_call_id": "c1", "content": "6"}
    echo = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calculator",
                                                                         "arguments": '{ "expression":"1+2+3" }'}}]}

    def env_after_two_calls():
        env = AgentEnv(None, None, {}, call_format("compact"), 1.0)
        env.opening, env.turn_texts = [user], {"c1": "==1+2+3="}
        env.answered = [Answered(ModelCall([user], None, None), "==1+2+3=", "", [("c1", "calculator",
                                                                                  {"expression": "1+2+3"})]),
                        Answered(ModelCall([user, echo, tool], None, None), "6", "6", [])]
        return env

    final = {"role": "assistant", "content": "6"}
    more = {"role": "user", "content": "again"}
    env = env_after_two_calls()  # extends the last call and its answer: appended, nothing kept back
    assert env.place([user, echo, tool, final, more]) == (None, [more]) and len(env.answered) == 2
    env = env_after_two_calls()  # the last turn retried
    assert env.place([user, echo, tool]) == (3, []) and len(env.answered) == 1
    env = env_after_two_calls()  # the last answer edited: back to before that turn
    assert env.place([user, echo, tool, {"role": "assistant", "content": "7"}, more]) == (
        3, [{"role": "assistant", "content": "7"}, more])
    env = env_after_two_calls()  # the tool's result rewritten: after the first turn, whose call the echo repeats
    assert env.place([user, echo, {**tool, "content": "9"}]) == (2, [{**tool, "content": "9"}])
    assert len(env.answered) == 1 and env.as_text(echo) == {"role": "assistant", "content": "==1+2+3="}
    env = env_after_two_calls()  # the opening rewritten: the episode restarts from it
    summary = [{"role": "user", "content": "1+2+3=6"}]
    assert env.place(summary) == (0, summary) and env.answered == [] and env.opening == summary
    foreign = {"role": "assistant", "content": None, "tool_calls": [{"id": "x9", "function": {}}]}
    with pytest.raises(RuntimeError, match="no model turn of this episode made"):
        env.as_text(foreign)


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="task.agent.program"):
        TaskConfig(name="agent")
    with pytest.raises(ConfigError, match="not both"):
        TaskConfig(name="agent", agent=AgentTaskConfig(program="m:f", command=["python", "a.py"]))
    with pytest.raises(ConfigError, match="task.agent.command"):
        AgentTaskConfig(command="python a.py")
    with pytest.raises(ConfigError, match="module:function"):
        AgentTaskConfig(program="no_colon")
