"""The math_tir task (pipelinerl/tasks/math_tir.py): scripted episodes with a Qwen2.5-style tokenizer and
template, through the real sandbox and math-verify grading. No server: the policy is scripted."""

import asyncio
import json

import pytest
from test_envs_episode import qwen_style_tokenizer
from test_envs_runner import ScriptedPolicy

from pipelinerl.config import TaskConfig
from pipelinerl.config.actor import SandboxConfig
from pipelinerl.envs.episode import EpisodeLimits
from pipelinerl.envs.runner import run_episode
from pipelinerl.tasks import get_task
from pipelinerl.tasks.math_tir import TIR_INSTRUCTION, sandbox_limits

ROWS = [{"question": "What is 6 times 7?", "answer": "42"}, {"question": "What is 2^10?", "answer": "1024"},
        {"question": "What is 1/2 + 1/3?", "answer": "\\frac{5}{6}"},
        {"question": "How many primes are below 10?", "answer": "4"}]
LIMITS = EpisodeLimits(max_turns=4, max_tokens_per_turn=512, max_total_tokens=8192)


def call(code: str) -> str:
    return "Let me compute it.\n<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + \
        "\n</tool_call>"


@pytest.fixture(scope="module")
def tok():
    return qwen_style_tokenizer()


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    path = tmp_path_factory.mktemp("math_tir") / "train.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in ROWS) + "\n")
    task = get_task(TaskConfig(name="math_tir", dataset_path=str(path), eval_fraction=0.25, reward_timeout_s=1,
                               sandbox=SandboxConfig(workers=2, timeout_s=5, cpu_s=1)))
    yield task
    task.close()


def episode(task, tok, texts: list[str], answer: str = "42"):
    item = next(i for i in task.train_items + task.eval_items if i.answer == answer)
    policy = ScriptedPolicy(tok, texts, versions=[0] * len(texts))
    return asyncio.run(run_episode(policy, task.environment(item), tok, LIMITS, step_timeout_s=30.0)), item


def test_a_python_call_then_the_boxed_answer_is_rewarded(task, tok):
    task.outcome_counts(reset=True)
    result, item = episode(task, tok, [call("print(6*7)"), "The tool says 42, so the answer is \\boxed{42}."])
    assert (result.reward, result.end_reason, result.error) == (1.0, "finished", None)
    assert (result.tool_calls, result.tool_errors) == (1, 0)
    kinds = [t.kind for t in result.episode.turns]
    assert kinds == ["prompt", "model", "env", "model"]
    assert "<tool_response>\n42\n\n</tool_response>" in result.episode.turns[2].text  # stdout "42\n", as printed
    assert task.outcome_counts()["correct"] == 1
    # the prompt: the template lists the python tool, the question carries the instruction
    prompt = result.episode.turns[0].text
    (listed,) = prompt.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    function = json.loads(listed)["function"]
    assert function["name"] == "python" and "code" in function["parameters"]["properties"]
    assert item.prompt == "What is 6 times 7?" + TIR_INSTRUCTION and item.prompt in prompt
    assert "python tool" in TIR_INSTRUCTION and "\\boxed{}" in TIR_INSTRUCTION


def test_a_wrong_answer_scores_zero(task, tok):
    result, _ = episode(task, tok, ["\\boxed{41}"])
    assert (result.reward, result.end_reason, result.tool_calls) == (0.0, "finished", 0)


def test_malformed_and_unknown_calls_are_answered_with_errors_and_counted(task, tok):
    unknown = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    result, _ = episode(task, tok, ["<tool_call>{not json}</tool_call>", unknown, "\\boxed{42}"])
    assert (result.reward, result.tool_calls, result.tool_errors) == (1.0, 2, 2)
    first, second = (t.text for t in result.episode.turns if t.kind == "env")
    assert "Error: the tool call is not valid JSON" in first
    assert "Error: unknown tool 'calculator'; the tools are: python" in second


def test_hostile_code_gets_a_failure_message_and_the_episode_goes_on(task, tok):
    result, _ = episode(task, tok, [call("while True:\n    pass"), call("1/0"), "\\boxed{42}"])
    assert (result.reward, result.end_reason, result.error) == (1.0, "finished", None)
    assert (result.tool_calls, result.tool_errors) == (2, 2)
    loop, crash = (t.text for t in result.episode.turns if t.kind == "env")
    assert "Error: the script failed (cpu_limit)" in loop or "Error: the script failed (timeout)" in loop
    assert "Error: the script failed (error: exit code 1)" in crash and "ZeroDivisionError" in crash


def test_the_sandbox_limits_come_from_task_sandbox():
    limits = sandbox_limits(SandboxConfig(workers=3, timeout_s=7, cpu_s=2, memory_mb=512, max_output_bytes=100))
    assert (limits.pool_size, limits.wall_s, limits.cpu_s, limits.memory_bytes, limits.max_output_bytes) == (
        3, 7, 2, 512 << 20, 100)
    assert not limits.allow_unconfined_fs and limits.tier == "auto"  # the default refuses tier C


def test_close_closes_the_sandbox_and_the_task_stays_usable(task, tok):
    item = task.train_items[0]
    task.environment(item)
    sandbox = task.sandbox

    async def close_inside_a_loop():
        task.close()

    asyncio.run(close_inside_a_loop())
    assert task.sandbox is None
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(sandbox.run("print(1)"))
    result, _ = episode(task, tok, [call("print(6*7)"), "\\boxed{42}"])  # a new sandbox
    assert result.reward == 1.0 and task.sandbox is not sandbox and task.sandbox is not None
