"""The episode runner (envs/runner.py) with the tiny tokenizer and a scripted policy: the tool_sums episode
token for token, every prefix a server was given is a prefix of the final sequence, and an environment that
raises, hangs or answers garbage ends only its own episode. Then the actor's stream row of an episode and
its statistics (actor/episodes.py), and the docs' example environment (docs/guides/episodes.md)."""

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipelinerl.actor.episodes import EpisodeStats, episode_rollout
from pipelinerl.config import TaskConfig
from pipelinerl.envs.environment import Environment, EnvReply, reply_problem
from pipelinerl.envs.episode import NO_VERSION, EpisodeLimits
from pipelinerl.envs.runner import ENV_ERROR, run_episode
from pipelinerl.streams.schema import group_batch
from pipelinerl.tasks.base import PromptItem
from pipelinerl.tasks.tool_sums import ToolSumsTask
from pipelinerl.tiny.model import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def task():
    return ToolSumsTask(TaskConfig(name="tool_sums"))


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finished: bool


class ScriptedPolicy:
    """Answers the k-th call with the k-th scripted text (+ EOS unless cut), at version `versions[k]`; a text
    with one of the call's `stop` strings ends with it instead of EOS, as a server stops. Records every prefix it
    was asked to continue, and every call's stop strings."""

    def __init__(self, tok, texts: list[str], versions: list[int], cut: set[int] = frozenset()):
        self.tok, self.texts, self.versions, self.cut, self.prefixes, self.stops = tok, texts, versions, cut, [], []

    async def __call__(self, prefix: list[int], max_tokens: int, stop: tuple[str, ...] = ()) -> Sampled:
        k = len(self.prefixes)
        self.prefixes.append(list(prefix))
        self.stops.append(stop)
        text = self.texts[k]
        end = min((i + len(s) for s in stop if (i := text.find(s)) >= 0), default=None)
        ids = self.tok.encode(text[:end], add_special_tokens=False)
        if k in self.cut:
            ids = ids[:max_tokens]
        elif end is None:
            ids = ids[:max_tokens - 1] + [self.tok.eos_token_id]
        n = len(ids)
        return Sampled(ids, [-0.5 - 0.01 * i for i in range(n)], [self.versions[k]] * n, finished=k not in self.cut)


LIMITS = EpisodeLimits(max_turns=4, max_tokens_per_turn=20, max_total_tokens=64)


def _run(policy, env, tok, limits=LIMITS, timeout_s=5.0):
    return asyncio.run(run_episode(policy, env, tok, limits, timeout_s))


def test_a_tool_sums_episode_is_built_token_for_token_and_rewarded(tok, task):
    item = task.train_items[0]
    a, b, c = map(int, item.prompt[:-1].split("+"))
    total = str(a + b + c)
    policy = ScriptedPolicy(tok, [f"=={a}+{b}+{c}=", total], versions=[3, 5])
    result = _run(policy, task.environment(item), tok)
    ep = result.episode
    assert result.reward == 1.0 and result.end_reason == "finished" and result.error is None
    assert (result.tool_calls, result.tool_errors) == (1, 0)
    # BOS prompt | ==a+b+c= EOS | total | total EOS, hand-assembled from the alphabet's ids
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    eos = tok.eos_token_id
    expected = ([tok.bos_token_id] + enc(item.prompt) + enc(f"=={a}+{b}+{c}=") + [eos] + enc(total)
                + enc(total) + [eos])
    assert ep.token_ids == expected
    p, call, tool = 1 + len(item.prompt), len(f"=={a}+{b}+{c}=") + 1, len(total)
    assert ep.loss_mask == [0] * p + [1] * call + [0] * tool + [1] * (tool + 1)
    assert ep.versions == [NO_VERSION] * p + [3] * call + [NO_VERSION] * tool + [5] * (tool + 1)
    # every server call continued a prefix of the final sequence, the whole sequence so far
    assert [len(x) for x in policy.prefixes] == [p, p + call + tool]
    assert all(ep.token_ids[:len(x)] == x for x in policy.prefixes)


def test_a_busy_slow_calculator_makes_the_item_call_again_as_its_demonstration_does(tok, monkeypatch):
    """task.tool_sums (configs/tiny_agent_long_tail.yaml): an item's calculator answers `-` its first k calls (k
    the item's own, geometric, capped), every call waits its delay (drawn: here forced to the bound), and the
    demonstration calls k + 1 times within the task's episode limits."""
    from pipelinerl.config.actor import ToolSumsConfig
    from pipelinerl.tasks import tool_sums
    from pipelinerl.tiny.warm_start import encode_episodes

    slow = ToolSumsTask(TaskConfig(name="tool_sums", tool_sums=ToolSumsConfig(max_busy=7, latency_s=0.3)))
    counts = [tool_sums.busy_calls(i, 7) for i in slow.train_items]
    assert max(counts) == 7 and 0.45 < counts.count(0) / len(counts) < 0.55  # half never busy, a tail to the cap
    assert counts == [tool_sums.busy_calls(i, 7) for i in slow.train_items]  # the item's own, every episode
    item = next(i for i, k in zip(slow.train_items, counts) if k == 2)
    call = "==" + item.prompt[:-1] + "="
    monkeypatch.setattr(tool_sums.random, "uniform", lambda low, high: high)
    started = time.monotonic()
    result = _run(ScriptedPolicy(tok, [call, call, call, item.answer], versions=[0, 1, 2, 3]),
                  slow.environment(item), tok, slow.episode_limits)
    took = time.monotonic() - started
    assert (result.end_reason, result.reward, result.tool_calls, result.tool_errors) == ("finished", 1.0, 3, 0)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    eos = tok.eos_token_id
    assert result.episode.token_ids == ([tok.bos_token_id] + enc(item.prompt) + (enc(call) + [eos] + enc("-")) * 2
                                        + enc(call) + [eos] + enc(item.answer) + enc(item.answer) + [eos])
    assert took >= 3 * 0.3  # three calls, each waited its (forced) delay
    impatient = _run(ScriptedPolicy(tok, [call, "1"], versions=[0, 1]), slow.environment(item), tok,
                     slow.episode_limits)  # answers after the busy reply, without the sum
    assert (impatient.end_reason, impatient.reward) == ("finished", 0.0)
    longest = [i for i, k in zip(slow.train_items, counts) if k == 7][:4]
    assert slow.demonstration(longest[0]) == ["==" + longest[0].prompt[:-1] + "="] * 8 + [longest[0].answer]
    instant = ToolSumsTask(TaskConfig(name="tool_sums", tool_sums=ToolSumsConfig(max_busy=7)))  # the warm start's
    _, labels = encode_episodes(tok, instant, longest)  # raises unless every demonstration solves its item
    assert labels.shape[1] <= instant.episode_limits.max_total_tokens


def test_wrong_answers_failed_calls_and_limits(tok, task):
    item = task.train_items[1]
    wrong = _run(ScriptedPolicy(tok, ["1"], [0]), task.environment(item), tok)
    assert wrong.reward == 0.0 and wrong.end_reason == "finished" and len(wrong.episode.model_turns) == 1
    # a call the calculator refuses (division by zero, a syntax error) is answered with `*`, and counted
    failed = _run(ScriptedPolicy(tok, ["==1-1=", "==5/0=", item.answer], [0, 0, 0]), task.environment(item), tok)
    assert (failed.tool_calls, failed.tool_errors, failed.reward) == (2, 1, 1.0)
    refused = _run(ScriptedPolicy(tok, ["==1--=", item.answer], [0, 0]), task.environment(item), tok)
    assert (refused.tool_calls, refused.tool_errors, refused.reward) == (1, 1, 1.0)
    star = tok.encode("*", add_special_tokens=False)
    assert refused.episode.turns[2].kind == "env" and refused.episode.token_ids[refused.episode.turns[2].start:
                                                                               refused.episode.turns[2].end] == star
    # the model calls forever: max_turns ends it truncated, reward 0
    looping = _run(ScriptedPolicy(tok, ["==1+1="] * 4, [0] * 4), task.environment(item), tok)
    assert looping.end_reason == "max_turns" and looping.reward == 0.0 and looping.episode.truncated
    assert len(looping.episode.model_turns) == 4
    # a turn cut at its token limit ends the episode
    cut = _run(ScriptedPolicy(tok, ["==1+1+1+1+1+1+1+1+1+1+1="], [0], cut={0}), task.environment(item), tok,
               limits=EpisodeLimits(max_turns=4, max_tokens_per_turn=6, max_total_tokens=64))
    assert cut.end_reason == "max_tokens_per_turn" and len(cut.episode.token_ids) == 1 + len(item.prompt) + 6


class BadEnv(Environment):
    def __init__(self, how: str):
        self.how, self.closed = how, False

    async def start(self):
        if self.how == "start_raise":
            raise OSError("no server")
        if self.how == "start_hang":
            await asyncio.sleep(3600)

    def messages(self):
        return [{"role": "user", "content": "1+1="}]

    async def step(self, text):
        if self.how.startswith("start"):
            raise AssertionError("step() after a failed start()")
        if self.how == "raise":
            raise KeyError("boom")
        if self.how == "hang":
            await asyncio.sleep(3600)
        return {"raise": None, "dict": {"messages": []}, "nan": EnvReply(done=True, reward=float("nan")),
                "no_messages": EnvReply(), "bad_role": EnvReply(messages=[{"role": "assistant", "content": "1"}]),
                "counts": EnvReply(done=True, tool_calls=1, tool_errors=2),
                "scores": EnvReply(done=True, reward=1.0, scores={"exact": float("inf")})}[self.how]

    async def close(self):
        self.closed = True


@pytest.mark.parametrize("how, reason", [("raise", "raised KeyError"), ("hang", "past its timeout of 0.2 s"),
                                         ("dict", "not an EnvReply"), ("nan", "finite number"),
                                         ("no_messages", "at least one message"), ("bad_role", "role in"),
                                         ("counts", "2 tool errors but only 1"), ("scores", "scores must map"),
                                         ("start_raise", "start() raised OSError: no server"),
                                         ("start_hang", "start() ran past its timeout of 0.2 s")])
def test_a_failing_environment_ends_only_its_episode(tok, how, reason):
    env = BadEnv(how)
    policy = ScriptedPolicy(tok, ["2"], [0])
    result = _run(policy, env, tok, timeout_s=0.2)
    assert result.end_reason == ENV_ERROR and result.reward == 0.0 and reason in result.error
    assert env.closed and not result.episode.truncated
    assert len(policy.prefixes) == 1 and len(result.episode.model_turns) == 1  # a failed start too: one turn


def test_reply_problem_accepts_good_replies():
    assert reply_problem(EnvReply(done=True, reward=1)) is None
    assert reply_problem(EnvReply(messages=[{"role": "tool", "content": "2"}], tool_calls=1, tool_errors=1)) is None
    assert "count" in reply_problem(EnvReply(done=True, tool_calls=True))
    assert reply_problem(EnvReply(done=True, reward=0.5, scores={"exact": 0, "format": 1.0})) is None


def test_an_episode_row_and_its_statistics(tok, task):
    item = task.train_items[2]
    good = _run(ScriptedPolicy(tok, [f"=={item.prompt[:-1]}=", item.answer], [1, 2]), task.environment(item), tok)
    bad = _run(ScriptedPolicy(tok, ["2"], [2]), BadEnv("raise"), tok)
    rows = [episode_rollout("run", "actor0/7", k, item, r, task.name, "actor0", {"prompt_index": 7})
            for k, r in enumerate([good, bad])]
    batch = group_batch(rows).to_pylist()
    n = good.episode.prompt_length
    assert batch[0]["prompt_token_ids"] == good.episode.token_ids[:n]
    assert batch[0]["prompt_token_ids"] + batch[0]["completion_token_ids"] == good.episode.token_ids
    assert batch[0]["loss_mask"] == good.episode.loss_mask[n:] and batch[0]["versions"] == good.episode.versions[n:]
    assert (batch[0]["turns"], batch[0]["tool_calls"], batch[0]["end_reason"], batch[0]["reward"]) == (2, 1,
                                                                                                     "finished", 1.0)
    assert batch[1]["end_reason"] == ENV_ERROR and not batch[1]["finished"] and not batch[1]["truncated"]
    assert "boom" in batch[1]["metadata"]
    stats = EpisodeStats()
    stats.add([good, bad])
    s = stats.scalars()
    assert s["actor/episode/turns"] == 1.5 and s["actor/episode/env_errors"] == 1.0
    assert s["actor/episode/straddling"] == 0.5 and s["actor/episode/tool_call_success"] == 1.0
    assert s["actor/episode/env_tokens"] == len(item.answer) / 2


def test_the_docs_environment_example_runs_with_the_real_sandbox():
    """docs/guides/episodes.md's "Writing an environment" code: a Python tool call through the sandbox, then the
    answer."""
    readme = (Path(__file__).resolve().parent.parent / "docs" / "guides" / "episodes.md").read_text()
    section = readme[readme.index("Writing an environment"):]
    start = section.index("```python\n") + len("```python\n")
    code = section[start:section.index("\n```", start)]
    namespace: dict = {}
    exec(compile(code, "episodes.md", "exec"), namespace)  # noqa: S102 -- the project's own docs
    env = namespace["PythonMathEnv"](PromptItem("q", "What is 6*7?", "42"))
    assert [t["function"]["name"] for t in env.tools] == ["python"]
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>'
    ran = asyncio.run(env.step(call))
    assert ran.messages == [{"role": "tool", "content": "42\n"}] and (ran.tool_calls, ran.tool_errors) == (1, 0)
    bad = asyncio.run(env.step("<tool_call>{not json}</tool_call>"))
    assert bad.tool_errors == 1 and bad.messages[0]["content"].startswith("Error:")
    assert asyncio.run(env.step(r"so \boxed{42}")) == EnvReply(done=True, reward=1.0)
    assert asyncio.run(env.step(r"so \boxed{41}")).reward == 0.0
    asyncio.run(namespace["SANDBOX"].close())
