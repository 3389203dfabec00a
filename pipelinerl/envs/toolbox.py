"""The tools an environment offers: their specs (shown to the model) and the runners that answer calls.

`Toolbox.answer` turns every parsed call (pipelinerl/envs/tool_calls.py) into an `Answer`: a malformed
call, an unknown tool or a tool's refusal of its input (a `ValueError`, e.g. the calculator's) is an
answer with `ok=False` and a message for the model, never an exception. Anything else a runner raises
is a bug and propagates.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipelinerl.envs.tool_calls import Parsed, ToolError, ToolSpec
from pipelinerl.envs.tools import calculator

if TYPE_CHECKING:
    from pipelinerl.envs.tools.sandbox import PythonSandbox, SandboxResult

Runner = Callable[[dict[str, Any]], Awaitable[str]]  # arguments (checked against the spec) -> answer text

PYTHON_SPEC = ToolSpec(
    "python", "Run a Python script in a fresh sandbox (no network, no files kept) and return what it printed.",
    {"type": "object", "required": ["code"],
     "properties": {"code": {"type": "string", "description": "the script; print() what you want back"}}})
CALCULATOR_SPEC = ToolSpec("calculator", calculator.SPEC_DESCRIPTION, calculator.SPEC_PARAMETERS)


@dataclass(frozen=True)
class Tool:
    spec: ToolSpec
    run: Runner


@dataclass(frozen=True)
class Answer:
    """What one call returned (`ok`), or why it failed (`ok=False`: the message for the model)."""

    text: str
    ok: bool


class Toolbox:
    """Named tools; `answer_all` runs one turn's calls concurrently and keeps their order."""

    def __init__(self, tools: Sequence[Tool]):
        names = [t.spec.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        self.tools = {t.spec.name: t for t in tools}

    @property
    def specs(self) -> list[ToolSpec]:
        return [t.spec for t in self.tools.values()]

    def template_tools(self) -> list[dict]:
        """The chat template's `tools` argument."""
        return [s.template_entry() for s in self.specs]

    async def answer(self, call: Parsed) -> Answer:
        if isinstance(call, ToolError):
            return Answer(call.message, ok=False)
        tool = self.tools.get(call.name)
        if tool is None:  # parsed against other specs than this toolbox's
            return Answer(f"unknown tool {call.name!r}; the tools are: {', '.join(self.tools) or 'none'}", ok=False)
        try:
            return Answer(await tool.run(call.arguments), ok=True)
        except ValueError as e:  # the tool refused the model's input
            return Answer(str(e), ok=False)

    async def answer_all(self, calls: Sequence[Parsed]) -> list[Answer]:
        return list(await asyncio.gather(*(self.answer(c) for c in calls)))


def calculator_tool() -> Tool:
    async def run(arguments: dict[str, Any]) -> str:
        return calculator.evaluate(arguments["expression"])

    return Tool(CALCULATOR_SPEC, run)


def python_tool(sandbox: PythonSandbox) -> Tool:
    """The Python sandbox as a tool: the answer is the script's stdout, or why it failed and its stderr."""

    async def run(arguments: dict[str, Any]) -> str:
        result = await sandbox.run(arguments["code"])
        if result.ok:
            return result.stdout + (" [output cut]" if result.truncated else "")
        raise ValueError(sandbox_failure(result))

    return Tool(PYTHON_SPEC, run)


def sandbox_failure(result: SandboxResult) -> str:
    """A failed run for the model: the reason, then the end of stderr (a traceback's last lines matter)."""
    tail = result.stderr[-2000:].strip()
    return f"the script failed ({result.reason})" + (f":\n{tail}" if tail else "")
