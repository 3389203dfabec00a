"""Tool-integrated math reasoning (TIR): the math task's problems, solved in episodes with a Python tool.

The data, the held-out split, the eval sets and the grading are MathTask's (math_task.py); the prompt
tells the model it may run Python and must box its final answer. Each episode is an environment:

    user: question + TIR_INSTRUCTION            (the chat template lists the `python` tool)
    assistant: ... <tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>
    tool: 42                                    (the script's stdout, or why it failed: timeout, traceback)
    assistant: ... \\boxed{42}                   (no call: the answer, graded by math-verify)

A turn without a tool call is the final answer: its last \\boxed{} is graded as MathTask grades a finished
completion (reward 1 for correct, else 0; counted in actor/outcome/*). A turn with calls (Qwen2.5's
`<tool_call>` format, envs/tool_calls.py) gets one `tool` message per call; a malformed call, an unknown
tool or a failed script is answered with an error message and counted as a tool error, and the episode
goes on until actor.episode's limits. Scripts run in one PythonSandbox per task (task.sandbox's limits),
built at the first episode and closed by close().
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib

from pipelinerl.config import TaskConfig
from pipelinerl.config.actor import SandboxConfig
from pipelinerl.envs.environment import Environment, EnvReply
from pipelinerl.envs.tool_calls import call_format
from pipelinerl.envs.toolbox import Toolbox, python_tool
from pipelinerl.envs.tools.sandbox import PythonSandbox, SandboxLimits
from pipelinerl.tasks.base import PromptItem
from pipelinerl.tasks.math_task import MathTask

# Appended to every question: the reward reads only the last \boxed{} of the turn without a tool call.
TIR_INSTRUCTION = ("\nPlease reason step by step. You may call the python tool to run code; it returns what the "
                   "code prints. Put your final answer within \\boxed{}.")
# How long close() waits for scripts still running to stop. Their own event loop may be gone (an actor
# stopped with episodes in flight), and then nothing reports them stopped: each still ends by its wall clock.
CLOSE_WAIT_S = 2.0


def sandbox_limits(cfg: SandboxConfig) -> SandboxLimits:
    """task.sandbox as the sandbox's limits; the others keep SandboxLimits' defaults."""
    return SandboxLimits(wall_s=cfg.timeout_s, cpu_s=cfg.cpu_s, memory_bytes=cfg.memory_mb << 20,
                         max_output_bytes=cfg.max_output_bytes, pool_size=cfg.workers,
                         allow_unconfined_fs=cfg.allow_unconfined_fs, run_as_uid_base=cfg.run_as_uid_base)


class MathTirEnv(Environment):
    """One episode: Qwen2.5 calls of the python tool, then a boxed answer graded by the task."""

    def __init__(self, task: MathTirTask, item: PromptItem, toolbox: Toolbox):
        self.task, self.item, self.toolbox, self.format = task, item, toolbox, call_format("qwen")
        self.tools = toolbox.template_tools()

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.item.prompt}]

    async def step(self, text: str) -> EnvReply:
        calls = self.format.parse(text, self.toolbox.specs)
        if not calls:  # the grading pool blocks until a worker answers: off the event loop
            reward = await asyncio.to_thread(self.task.reward, self.item, text, True)
            return EnvReply(done=True, reward=reward)
        answers = await self.toolbox.answer_all(calls)
        return EnvReply(messages=[{"role": "tool", "content": self.format.reply(a.text, a.ok)} for a in answers],
                        tool_calls=len(answers), tool_errors=sum(not a.ok for a in answers))


class MathTirTask(MathTask):
    name = "math_tir"
    multi_turn = True

    def __init__(self, cfg: TaskConfig):
        super().__init__(cfg)
        self.sandbox: PythonSandbox | None = None
        self._toolbox: Toolbox | None = None

    def prompt_text(self, question: str) -> str:
        return question + TIR_INSTRUCTION

    def environment(self, item: PromptItem) -> MathTirEnv:
        """An episode's environment. The first one builds the sandbox, whose start-up probe (a fraction of a
        second, once) picks its confinement tier or raises ValueError where none is allowed."""
        if self.sandbox is None:
            self.sandbox = PythonSandbox(sandbox_limits(self.cfg.sandbox))
            self._toolbox = Toolbox([python_tool(self.sandbox)])
        return MathTirEnv(self, item, self._toolbox)

    def close(self) -> None:
        """Close the grading workers and the sandbox (scripts in flight end "killed: close"); the next episode
        builds a new sandbox."""
        super().close()
        sandbox, self.sandbox, self._toolbox = self.sandbox, None, None
        if sandbox is not None:  # on a thread of its own: close() may be called inside a running event loop
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pool.submit(asyncio.run, _close(sandbox)).result()


async def _close(sandbox: PythonSandbox) -> None:
    with contextlib.suppress(asyncio.TimeoutError):  # Python 3.10's is not yet the built-in TimeoutError
        await asyncio.wait_for(sandbox.close(), CLOSE_WAIT_S)
