"""A verifiers (v1) environment run as our episodes (tasks/verifiers_task.py, envs/verifiers_env.py), with the
real verifiers package and environments written against its API (tests/verifiers_envs/): its rollout's tool
server, harness, stop condition and reward functions act; its model calls are our runner's turns, sampled
here by a scripted policy on the tiny tokenizer. One served environment (its MCP tool server is a process)
for the module, on one event loop."""

import asyncio
import os
import sys
from pathlib import Path

import pytest
from test_envs_runner import ScriptedPolicy

from pipelinerl.actor.episodes import EpisodeStats
from pipelinerl.config import TaskConfig
from pipelinerl.config.actor import VerifiersConfig
from pipelinerl.envs.episode import EpisodeLimits
from pipelinerl.envs.runner import ENV_ERROR, run_episode
from pipelinerl.tasks import get_task
from pipelinerl.tiny.model import build_tokenizer

ENVS = str(Path(__file__).parent / "verifiers_envs")
LIMITS = EpisodeLimits(max_turns=4, max_tokens_per_turn=20, max_total_tokens=96)


@pytest.fixture(scope="module", autouse=True)
def envs_on_path():
    """verifiers imports the environments by module name, here and in the tool server it starts."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = ENVS + (os.pathsep + old if old else "")
    sys.path.insert(0, ENVS)
    yield
    sys.path.remove(ENVS)
    os.environ.pop("PYTHONPATH") if old is None else os.environ.update(PYTHONPATH=old)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _task(loop, request, env, **fields):
    task = get_task(TaskConfig(name="verifiers", verifiers=VerifiersConfig(env=env, **fields)))
    request.addfinalizer(lambda: loop.run_until_complete(task.stop_serving()))
    return task


@pytest.fixture(scope="module")
def sums(loop, request):
    return _task(loop, request, "vf_tiny_sums", args={"num_rows": 50}, eval_args={"split": "test", "num_rows": 10},
                 tool_format="compact")


def _episode(loop, task, item, tok, texts, limits=LIMITS):
    policy = ScriptedPolicy(tok, texts, versions=list(range(len(texts))))
    return loop.run_until_complete(run_episode(policy, task.environment(item), tok, limits, 60.0)), policy


def _call(item) -> str:
    return "==" + item.prompt[:-1] + "="


def test_rows_become_items_and_the_eval_split_comes_from_eval_args(sums):
    assert len(sums.train_items) == 50 and len(sums.eval_items) == 10
    assert all(i.id.startswith("train-") for i in sums.train_items)
    assert all(i.id.startswith("test-") for i in sums.eval_items)
    item = sums.train_items[0]
    a, b, c = map(int, item.prompt[:-1].split("+"))
    assert item.answer == str(a + b + c)


def test_a_tool_episode_runs_verifiers_tool_and_rewards_token_for_token(loop, sums, tok):
    item = sums.train_items[0]
    result, policy = _episode(loop, sums, item, tok, [_call(item), item.answer])
    assert (result.end_reason, result.error, result.reward) == ("finished", None, 1.0)
    assert result.scores == {"correct": 1.0, "called_calculator": 1.0}
    assert (result.tool_calls, result.tool_errors) == (1, 0)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    eos = tok.eos_token_id
    # BOS prompt | call EOS | the calculator's answer (verifiers' MCP tool server) | answer EOS
    expected = ([tok.bos_token_id] + enc(item.prompt) + enc(_call(item)) + [eos] + enc(item.answer)
                + enc(item.answer) + [eos])
    ep = result.episode
    assert ep.token_ids == expected
    assert all(ep.token_ids[:len(p)] == p for p in policy.prefixes)  # every call continued the exact prefix
    assert ep.versions[ep.prompt_length:].count(0) == len(enc(_call(item))) + 1


def test_a_wrong_answer_scores_zero_with_each_function_score(loop, sums, tok):
    item = sums.train_items[1]
    result, _ = _episode(loop, sums, item, tok, [_call(item), "1"])
    assert (result.end_reason, result.reward) == ("finished", 0.0)
    assert result.scores == {"correct": 0.0, "called_calculator": 1.0}
    direct, _ = _episode(loop, sums, item, tok, [item.answer])  # the right sum without the calculator
    assert (direct.reward, direct.scores, direct.tool_calls) == (1.0, {"correct": 1.0, "called_calculator": 0.0}, 0)
    stats = EpisodeStats()
    stats.add([result, direct])
    scalars = stats.scalars()
    assert scalars["actor/episode/score/correct"] == 0.5 and scalars["actor/episode/score/called_calculator"] == 0.5


def test_the_environments_stop_condition_ends_the_episode_scored(loop, sums, tok):
    item = sums.train_items[2]
    env = sums.environment(item)
    policy = ScriptedPolicy(tok, [_call(item)] * 6, versions=[0] * 6)
    limits = EpisodeLimits(max_turns=6, max_tokens_per_turn=20, max_total_tokens=200)
    result = loop.run_until_complete(run_episode(policy, env, tok, limits, 60.0))
    trace = env.episode.traces[0]
    # @vf.stop three_tool_calls sees a call's tool message once the next call commits it: the 4th call is
    # answered, the 5th refused
    assert (trace.stop_condition, len(trace.tool_messages), len(policy.prefixes)) == ("three_tool_calls", 3, 4)
    assert (result.end_reason, result.error) == ("finished", None)
    assert result.scores == {"correct": 0.0, "called_calculator": 1.0}


def test_a_malformed_call_is_counted_and_ends_the_rollout_as_a_reply(loop, sums, tok):
    item = sums.train_items[3]
    result, policy = _episode(loop, sums, item, tok, ["==12+", item.answer])
    assert len(policy.prefixes) == 1  # no parsable call: the harness took the text as the final reply
    assert (result.end_reason, result.reward, result.tool_calls, result.tool_errors) == ("finished", 0.0, 1, 1)


def test_our_limits_end_the_episode_and_wind_the_rollout_down(loop, sums, tok):
    from pipelinerl.envs.verifiers_env import CLIENT

    item = sums.train_items[4]
    env = sums.environment(item)
    policy = ScriptedPolicy(tok, [_call(item)] * 3, versions=[0] * 3)
    limits = EpisodeLimits(max_turns=2, max_tokens_per_turn=20, max_total_tokens=96)
    result = loop.run_until_complete(run_episode(policy, env, tok, limits, 60.0))
    assert (result.end_reason, result.error, result.reward) == ("max_turns", None, 0.0)
    assert env.program.done() and not env.program.cancelled()  # verifiers ended its rollout itself
    assert env.episode.traces[0].stop_condition is not None
    assert not CLIENT.episodes  # no route left to an ended episode


def test_episodes_run_side_by_side(loop, sums, tok):
    items = sums.train_items[5:21]

    async def all_of_them():
        return await asyncio.gather(*[
            run_episode(ScriptedPolicy(tok, [_call(i), i.answer], versions=[0, 1]), sums.environment(i), tok, LIMITS,
                        60.0) for i in items])

    results = loop.run_until_complete(all_of_them())
    assert [r.reward for r in results] == [1.0] * len(items)
    for item, r in zip(items, results, strict=True):  # each rollout got its own calculator answer
        assert tok.decode(r.episode.token_ids).count(item.answer) == 2


def test_more_rollouts_than_an_http_pool_park_their_first_calls_together(loop, sums, tok):
    """Each parked model call holds its connection to the interception endpoint until our turn answers it: 150
    rollouts (more than aiohttp's default pool of 100) all reach their first call, and none waits for a slot."""
    items = [sums.train_items[i % 50] for i in range(150)]
    envs = [sums.environment(i) for i in items]

    async def start_then_close():
        started = await asyncio.gather(*[asyncio.wait_for(e.start(), 120.0) for e in envs], return_exceptions=True)
        asked = [e.pending.messages[-1]["content"] if e.pending else None for e in envs]
        await asyncio.gather(*[e.close() for e in envs])
        return started, asked

    started, asked = loop.run_until_complete(start_then_close())
    assert [r for r in started if r is not None] == []
    assert asked == [i.prompt for i in items]


def test_a_reward_function_that_raises_ends_the_episode_as_an_env_error(loop, request, tok):
    task = _task(loop, request, "vf_tiny_sums", args={"num_rows": 10, "task": {"raise_in_reward": True}},
                 tool_format="compact")
    item = task.train_items[0]
    result, _ = _episode(loop, task, item, tok, [item.answer])
    assert (result.end_reason, result.reward) == (ENV_ERROR, 0.0)
    assert "the reward function failed on purpose" in result.error


def test_a_rollout_that_fails_before_its_first_call_ends_after_one_turn(loop, request, tok):
    task = _task(loop, request, "vf_tiny_sums", args={"num_rows": 10, "task": {"raise_in_setup": True}},
                 tool_format="compact")
    item = task.train_items[0]
    result, policy = _episode(loop, task, item, tok, [_call(item), item.answer])
    assert (result.end_reason, result.reward, len(policy.prefixes)) == (ENV_ERROR, 0.0, 1)
    assert "before its first model call" in result.error and "setup failed on purpose" in result.error
    # the row's opening is the task's own prompt, as the harness would have sent it
    assert result.episode.token_ids[:result.episode.prompt_length] == [tok.bos_token_id] + tok.encode(
        item.prompt, add_special_tokens=False)


def test_a_single_turn_environment_with_weighted_rewards(loop, request, tok):
    task = _task(loop, request, "vf_tiny_add", args={"num_rows": 40})
    assert len(task.train_items) + len(task.eval_items) == 40  # held out: task.eval_fraction of the rows
    item = task.train_items[0]
    result, _ = _episode(loop, task, item, tok, [item.answer])
    assert (result.reward, result.scores) == (1.5, {"exact": 1.0, "right_length": 1.0})
    assert result.episode.tools is None and len(result.episode.model_turns) == 1
    wrong, _ = _episode(loop, task, item, tok, ["1"])
    assert (wrong.reward, wrong.scores) == (0.0, {"exact": 0.0, "right_length": 0.0})


def test_a_judge_at_judge_url_is_answered_by_the_runs_judge_servers(loop, request, tok, tmp_path):
    """tests/verifiers_envs/vf_tiny_judged.py's reward is a vf.Judge at JUDGE_URL: with no judge servers its
    rollout ends as an environment error saying what to set; with the actor's client (here on a fake judge
    server at a discovery file), each verdict is a chat completion of that server, sent without the judge's model."""
    import json

    import httpx

    from pipelinerl.actor import CompletionsClient
    from pipelinerl.config import load_config
    from pipelinerl.envs.verifiers_judge import ROUTE
    from pipelinerl.rundir import REWARD_SERVERS_DIR

    task = _task(loop, request, "vf_tiny_judged", args={"num_rows": 10})
    item = task.train_items[0]
    ROUTE.use(None, None)
    unrouted, _ = _episode(loop, task, item, tok, [item.answer])
    assert unrouted.end_reason == ENV_ERROR and "reward.kind=judge" in unrouted.error, unrouted.error

    cfg = load_config(Path(__file__).parent.parent / "configs" / "tiny_cpu.yaml",
                      [f"run_dir={tmp_path}", "reward.kind=judge", f"reward.model_path={tmp_path}"])
    (tmp_path / REWARD_SERVERS_DIR).mkdir()
    (tmp_path / REWARD_SERVERS_DIR / "j_1").write_text("http://j:1\n")
    asked = []

    def judge_server(http_request: httpx.Request) -> httpx.Response:
        body = json.loads(http_request.content)
        asked.append((http_request.url.path, body))
        question = body["messages"][0]["content"]
        verdict = "yes" if question.endswith(f"A: {item.answer} R: {item.answer}") else "no"
        return httpx.Response(200, json={"id": "j", "object": "chat.completion", "created": 0, "model": "served",
                                         "choices": [{"index": 0, "finish_reason": "stop",
                                                      "message": {"role": "assistant", "content": verdict}}]})

    http = httpx.AsyncClient(transport=httpx.MockTransport(judge_server))
    ROUTE.use(CompletionsClient(cfg.actor, str(tmp_path), reference=False, reward=True), http)
    request.addfinalizer(lambda: ROUTE.use(None, None))
    right, _ = _episode(loop, task, item, tok, [item.answer])
    wrong, _ = _episode(loop, task, item, tok, ["1"])
    assert (right.end_reason, right.reward, wrong.reward) == ("finished", 1.0, 0.0), (right.error, wrong.error)
    assert right.scores == {"judged": 1.0}
    assert [path for path, _ in asked] == ["/v1/chat/completions"] * 2 and not any("model" in b for _, b in asked)
    assert [b["messages"] for _, b in asked] == [[{"role": "user", "content": f"Q: {item.prompt} A: {item.answer} "
                                                                              f"R: {reply}"}]
                                                  for reply in (item.answer, "1")]


def test_judge_servers_are_for_a_verifiers_environments_judges_only(tmp_path):
    from pipelinerl.config import ConfigError, load_config

    config = Path(__file__).parent.parent / "configs" / "tiny_verifiers.yaml"
    judge = [f"run_dir={tmp_path}", "reward.kind=judge", f"reward.model_path={tmp_path}"]
    assert load_config(config, judge).reward.servers_started == 1
    with pytest.raises(ConfigError, match="reward.kind"):
        load_config(config, [f"run_dir={tmp_path}", "reward.kind=model", f"reward.model_path={tmp_path}"])
    with pytest.raises(ConfigError, match="reward.kind"):
        load_config(Path(__file__).parent.parent / "configs" / "tiny_tools.yaml", judge)
