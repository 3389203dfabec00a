"""An episode whose conversation a program drives through chat model calls: a verifiers rollout
(envs/verifiers_env.py), an agent on the OpenAI API (envs/agent_gateway.py).

The program runs as a task of the actor's event loop. Each of its model calls (the whole conversation so far, and
the tools it offers) parks until our episode runner (envs/runner.py) has sampled the model's turn on our servers,
token-in/token-out, and answers it with the turn's text and the tool calls parsed from it:

    start():     the program starts; its first call's messages and tools open the episode
    step(text):  the parked call is answered (content, tool calls in `call_format`; with the call's stop strings,
                 the text before the first, which ended the turn: the turn keeps its tokens) -> the next call:
                 the messages it added after our turn (tool results, a user's reply) are the EnvReply; or the
                 program ends: EnvReply(done) with its reward and the reward's parts
    close():     if our episode ended first (a limit), the parked call fails with the subclass's `ended_error()`
                 and the program gets CLOSE_TIMEOUT_S to wind down before it is cancelled

A call that does not extend the conversation of the call before goes back in it (a retried turn, an earlier
message edited or dropped, a summarised context): the episode branches (episode.py) from the last of its calls
whose messages the new call still starts with, after that call's model turn if the new call repeats the answer
it got, before it otherwise (no call's: the longest run of opening messages they share). The messages after that
point are rendered again (assistant messages included, loss mask 0), and the model tokens of the turns cut off
are counted as drift, never trained. A call the program gave up on (`gone`: the gateway's client closed its
connection) has an answer nobody read: the next call cannot extend it, and if the program ends instead, that
turn stays in the sequence with loss mask 0.
"""

from __future__ import annotations

import abc
import asyncio
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pipelinerl.envs.environment import BRANCH_ROLES, MESSAGE_ROLES, Environment, EnvReply
from pipelinerl.envs.tool_calls import CallFormat, ToolCall, ToolSpec

CLOSE_TIMEOUT_S = 30.0  # for a program to wind down once our episode has ended it


@dataclass
class ModelCall:
    """One model call of the program, parked until the episode's model turn answers it with
    (content, [{"id", "name", "arguments" (JSON text)}])."""

    messages: list[dict]
    tools: list[dict] | None
    answer: asyncio.Future
    stop: tuple[str, ...] = ()  # strings that end the model's turn; the answer is its text before the first
    gone: Callable[[], bool] = lambda: False  # whether the caller gave up waiting (nobody will read the answer)
    abandoned: bool = False  # the caller was gone once the answer was ready
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # set once `abandoned` is known


@dataclass
class Answered:
    """A call the episode's sequence answered: the call, the model turn's text and the assistant message the
    program got ((content, [(call id, name, arguments)]))."""

    call: ModelCall
    text: str
    content: str
    tool_calls: list[tuple[str, str, object]]


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
        self.opening: list[dict] = []
        self.program: asyncio.Task | None = None
        self.ended = False
        self.answered: list[Answered] = []  # the calls the sequence's model turns answered, in order
        self.turn_texts: dict[str, str] = {}  # tool call id -> the text of the model turn that made the call

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
        self.opening = self.prompt  # the messages the episode's sequence opens with (a branch may restart it)

    async def model_call(self, messages: list[dict], tools: list[dict] | None,
                         gone: Callable[[], bool] | None = None,
                         stop: Sequence[str] = ()) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of the model's turn that answers this call of the program. `gone`: whether the
        caller has given up waiting, checked once the answer is ready; `stop`: the call's stop strings (the
        server stops the turn at one; the answer is the text before it, the turn keeps its tokens)."""
        if self.ended:
            raise self.ended_error()
        call = ModelCall(messages, tools, asyncio.get_running_loop().create_future(), tuple(stop),
                         gone or (lambda: False))
        self.calls.put_nowait(call)
        try:
            return await call.answer
        finally:
            call.abandoned = call.gone()
            call.settled.set()

    def messages(self) -> list[dict]:
        return [dict(m) for m in self.prompt] if self.prompt else self.opening_messages()

    @property
    def stop(self) -> tuple[str, ...]:
        return self.pending.stop if self.pending is not None else ()

    async def step(self, text: str) -> EnvReply:
        seen = before_stop(text, self.pending.stop)  # what the program gets: the text before a stop string
        parsed = self.format.parse(seen, tool_specs(self.tools)) if self.tools else []
        calls = [c for c in parsed if isinstance(c, ToolCall)]
        content = seen
        for c in calls:
            content = content.replace(c.text, "", 1)
        content = content if content.strip() or not calls else None
        answer = [{"id": f"call_{uuid.uuid4().hex[:12]}", "name": c.name, "arguments": json.dumps(c.arguments)}
                  for c in calls]
        self.pending.answer.set_result((content, answer))
        self.answered.append(Answered(self.pending, text, content or "",
                                      [(a["id"], a["name"], c.arguments) for a, c in zip(answer, calls, strict=True)]))
        self.turn_texts.update((a["id"], text) for a in answer)
        counts = {"tool_calls": len(parsed), "tool_errors": len(parsed) - len(calls)}
        asked, self.pending = self.pending, await self.calls.get()
        if self.pending is None:
            end = await self.program
            await asyncio.wait_for(asked.settled.wait(), CLOSE_TIMEOUT_S)  # its caller's check follows the answer
            keep = len(asked.messages) if asked.abandoned else None
            return EnvReply(done=True, reward=float(end.reward), scores=end.scores, keep_messages=keep, **counts)
        keep, new = self.place(self.pending.messages)
        if keep is None:
            if any(m.get("role") not in MESSAGE_ROLES or not isinstance(m.get("content"), str) for m in new):
                raise RuntimeError(f"the program added messages other than {MESSAGE_ROLES} with text after the "
                                   f"model's turn: {str(new)[:300]}")
            return EnvReply(messages=[{"role": m["role"], "content": m["content"]} for m in new], **counts)
        return EnvReply(messages=[self.as_text(m) for m in new], keep_messages=keep, **counts)

    def place(self, now: list[dict]) -> tuple[int | None, list[dict]]:
        """Where the call with messages `now` continues the conversation: (None, its new messages) when it extends
        the last answered call and the answer it got with more messages; else (the messages kept, the messages
        after them), and the answered calls after that point are forgotten (module doc)."""
        keep = None
        for j in range(len(self.answered) - 1, -1, -1):
            done = self.answered[j]
            before = done.call.messages
            if now[:len(before)] == before:
                extends = not done.call.abandoned and len(now) > len(before) and _same_answer(now[len(before)], done)
                if extends and j == len(self.answered) - 1 and len(now) > len(before) + 1:
                    return None, now[len(before) + 1:]
                del self.answered[j + extends:]
                keep = len(before) + extends
                break
        if keep is None:
            self.answered.clear()
            keep = next((i for i, (a, b) in enumerate(zip(now, self.opening)) if a != b),
                        min(len(now), len(self.opening)))
        if not self.answered:  # no model turn kept: the episode restarts from these messages
            self.opening = now
        return keep, now[keep:]

    def as_text(self, message: dict) -> dict:
        """A message of a branch as the chat template renders it: role and text. An assistant message is the text
        of the model turn whose tool calls it carries, or its content; tool calls that none of our turns made
        cannot be written in the model's format."""
        role, content = message.get("role"), message.get("content")
        if role not in MESSAGE_ROLES + BRANCH_ROLES:
            raise RuntimeError(f"a message of role {role!r} cannot be rendered: {str(message)[:300]}")
        if isinstance(content, list):  # content parts: their text
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        ids = [c.get("id") for c in message.get("tool_calls") or () if isinstance(c, dict)]
        if role == "assistant" and (message.get("tool_calls") or ids):
            texts = {self.turn_texts.get(i) for i in ids}
            if len(texts) != 1 or None in texts or len(ids) != len(message["tool_calls"]):
                raise RuntimeError(f"an assistant message with tool calls no model turn of this episode made cannot "
                                   f"be rendered in the model's format: {str(message)[:300]}")
            return {"role": role, "content": texts.pop()}
        if not isinstance(content, str | None):
            raise RuntimeError(f"a message without text content cannot be rendered: {str(message)[:300]}")
        return {"role": role, "content": content or ""}

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


def before_stop(text: str, stop: Sequence[str]) -> str:
    """`text` up to the first of the `stop` strings in it (all of it if none is): a completion as OpenAI's API
    returns it, its stop string left out."""
    return text[:min((i for s in stop if (i := text.find(s)) >= 0), default=len(text))]


def _same_answer(message: dict, done: Answered) -> bool:
    """Whether the program's copy of an assistant message is the answer it got: the same content (None as "";
    or the model turn's whole text, its stop string included) and the same tool calls (ids, names, and arguments
    as JSON values)."""
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return False
    if (message.get("content") or "") not in (done.content, done.text):
        return False
    try:
        calls = [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                 for c in message.get("tool_calls") or ()]
    except (KeyError, TypeError, ValueError, RecursionError):
        return False
    return calls == done.tool_calls
