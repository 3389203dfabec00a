"""An episode whose conversation a program drives through chat model calls: a verifiers rollout
(envs/verifiers_env.py), an agent on the OpenAI API (envs/agent_gateway.py).

The program runs as a task of the actor's event loop. Each of its model calls (the whole conversation so far, and
the tools it offers) parks until our episode runner (envs/runner.py) has sampled the model's turn on our servers,
token-in/token-out, and answers it with the turn's text and the tool calls parsed from it:

    start():     the program starts; its first call's messages and tools open the episode
    step(text):  the parked call is answered (content, tool calls in `call_format`) -> the program's next call:
                 the messages it added after our turn (tool results, a user's reply) are the EnvReply; or the
                 program ends: EnvReply(done) with its reward and the reward's parts
    close():     if our episode ended first (a limit), the parked call fails with the subclass's `ended_error()`
                 and the program gets CLOSE_TIMEOUT_S to wind down before it is cancelled

A call that does not extend the conversation of the call before (an earlier message edited or dropped) cannot be
continued token-exactly: the episode ends as an environment error with that reason, as when the program raises.
"""

from __future__ import annotations

import abc
import asyncio
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipelinerl.envs.environment import MESSAGE_ROLES, Environment, EnvReply
from pipelinerl.envs.tool_calls import CallFormat, ToolCall, ToolSpec

CLOSE_TIMEOUT_S = 30.0  # for a program to wind down once our episode has ended it


@dataclass
class ModelCall:
    """One model call of the program, parked until the episode's model turn answers it with
    (content, [{"id", "name", "arguments" (JSON text)}])."""

    messages: list[dict]
    tools: list[dict] | None
    answer: asyncio.Future


@dataclass
class ProgramEnd:
    """What the program's end gives the episode: its reward and the reward's parts by name."""

    reward: float
    scores: dict[str, float] = field(default_factory=dict)


def tool_specs(tools: Sequence[dict] | None) -> list[ToolSpec]:
    """The parser's view of the OpenAI function tools a call offers."""
    return [ToolSpec(f["function"]["name"], f["function"].get("description") or "",
                     f["function"].get("parameters") or {"type": "object", "properties": {}}) for f in tools or ()]


class ChatProgramEnv(Environment):
    """The machinery; a subclass runs the program (`run_program`) and says what a failed start shows the model
    (`opening_messages`) and what a call gets once our episode has ended (`ended_error`)."""

    def __init__(self, call_format: CallFormat):
        self.format = call_format
        self.calls: asyncio.Queue[ModelCall | None] = asyncio.Queue()
        self.pending: ModelCall | None = None
        self.prompt: list[dict] = []
        self.program: asyncio.Task | None = None
        self.ended = False

    @abc.abstractmethod
    async def run_program(self) -> ProgramEnd:
        """Run the program to its end (its model calls go through `model_call`); raise if it failed."""

    @abc.abstractmethod
    def opening_messages(self) -> list[dict]:
        """The messages the episode opens with when the program failed before its first call."""

    def ended_error(self) -> Exception:
        return RuntimeError("the episode has ended (a limit of the trainer's episode)")

    async def start(self) -> None:
        self.program = asyncio.create_task(self.run_program())
        self.program.add_done_callback(lambda _: self.calls.put_nowait(None))
        self.pending = await self.calls.get()
        if self.pending is None:
            raise RuntimeError(f"the program ended before its first model call: {self.failure()}")
        self.prompt, self.tools = self.pending.messages, self.pending.tools

    async def model_call(self, messages: list[dict], tools: list[dict] | None) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of the model's turn that answers this call of the program."""
        if self.ended:
            raise self.ended_error()
        call = ModelCall(messages, tools, asyncio.get_running_loop().create_future())
        self.calls.put_nowait(call)
        return await call.answer

    def messages(self) -> list[dict]:
        return [dict(m) for m in self.prompt] if self.prompt else self.opening_messages()

    async def step(self, text: str) -> EnvReply:
        parsed = self.format.parse(text, tool_specs(self.tools)) if self.tools else []
        calls = [c for c in parsed if isinstance(c, ToolCall)]
        content = text
        for c in calls:
            content = content.replace(c.text, "", 1)
        self.pending.answer.set_result((content if content.strip() or not calls else None,
                                        [{"id": f"call_{uuid.uuid4().hex[:12]}", "name": c.name,
                                          "arguments": json.dumps(c.arguments)} for c in calls]))
        counts = {"tool_calls": len(parsed), "tool_errors": len(parsed) - len(calls)}
        asked, self.pending = self.pending, await self.calls.get()
        if self.pending is None:
            end = await self.program
            return EnvReply(done=True, reward=float(end.reward), scores=end.scores, **counts)
        return EnvReply(messages=self.new_messages(asked.messages), **counts)

    def new_messages(self, before: list[dict]) -> list[dict]:
        """The messages the program added after our last turn: the previous call's messages, our turn, then
        these (tool results, a user's reply)."""
        now = self.pending.messages
        if now[:len(before)] != before or len(now) <= len(before) + 1 or now[len(before)]["role"] != "assistant":
            raise RuntimeError("the program's model call does not extend the conversation it sent before (an "
                               "earlier message edited or dropped): the episode cannot be continued token-exactly")
        new = now[len(before) + 1:]
        if any(m.get("role") not in MESSAGE_ROLES or not isinstance(m.get("content"), str) for m in new):
            raise RuntimeError(f"the program added messages other than {MESSAGE_ROLES} with text after the "
                               f"model's turn: {str(new)[:300]}")
        return [{"role": m["role"], "content": m["content"]} for m in new]

    def failure(self) -> str:
        """Why the program ended."""
        if self.program is None or not self.program.done():
            return "the program is still running"
        if self.program.cancelled():
            return "the program was cancelled"
        err = self.program.exception()
        return f"{type(err).__name__}: {err}" if err is not None else "it returned"

    async def close(self) -> None:
        self.ended = True
        try:
            if self.program is not None and not self.program.done():
                while self.pending is not None:
                    if not self.pending.answer.done():
                        self.pending.answer.set_exception(self.ended_error())
                    self.pending = await asyncio.wait_for(self.calls.get(), CLOSE_TIMEOUT_S)
                await asyncio.wait_for(asyncio.shield(self.program), CLOSE_TIMEOUT_S)
        except TimeoutError:
            self.program.cancel()
        except Exception:  # noqa: BLE001, S110 -- the program's own failure after our episode ended changes nothing
            pass
