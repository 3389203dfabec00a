"""A verifiers (v1) environment's rollout as one of our episodes, turn by turn.

verifiers runs a rollout itself: its harness (the chat loop: envs/verifiers_harness.py by default) sends each
model call to an interception server in this process, which asks a `vf.Client` for the reply; its task's
tools, stop conditions (`@vf.stop`), limits and rewards (`@vf.reward`) all act inside that rollout. Here the
client is `ActorClient`: a call parks until our episode runner (envs/runner.py) has sampled the model's turn
on our servers, token-in/token-out. So a `VerifiersEnv` episode is, per turn:

    runner: env.start()       -> verifiers starts the rollout; its first model call gives the messages, tools
    runner: model turn (tokens, versions) -> env.step(text): the text's tool calls (task.verifiers.tool_format)
            answer the parked call; the harness runs them -> its next call: the new tool/user messages are the
            EnvReply (our Episode renders them after the exact tokens so far)
    ...     the harness ends (a reply without tool calls, a stop condition) -> verifiers scores the rollout:
            EnvReply(done, reward = trace.reward, scores = each reward function's score)

A rollout verifiers records as failed (a reward function or tool server that raises, a harness that dies)
ends our episode as an environment error (reward 0, counted): `step` raises with verifiers' own errors. A
harness that rewrites the conversation it sent before (an edited or dropped earlier message) cannot be
continued token-exactly: the episode ends the same way, with the reason.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import verifiers.v1 as vf
import verifiers.v1.interception.server as interception
from verifiers.v1.clients.train import serialize_completion, tool_to_wire
from verifiers.v1.dialects.chat import message_to_wire

from pipelinerl.envs import verifiers_harness
from pipelinerl.envs.environment import MESSAGE_ROLES, Environment, EnvReply
from pipelinerl.envs.tool_calls import CallFormat, ToolCall, ToolSpec
from pipelinerl.envs.verifiers_harness import first_messages

ACTOR_URL = "http://pipelinerl.actor.invalid/v1"  # the client config that selects ActorClient (never dialled)
CLOSE_TIMEOUT_S = 30.0  # for verifiers to wind a rollout down once our episode has ended it


@dataclass
class _Call:
    """One model call of a rollout, parked until the episode's model turn answers it."""

    messages: list[dict]
    tools: list[dict] | None
    answer: asyncio.Future


class ActorClient(vf.Client):
    """verifiers' model client for every rollout of this process: routes a call to the episode whose trace it
    belongs to (the session id is the trace id)."""

    def __init__(self):
        self.episodes: dict[str, VerifiersEnv] = {}

    async def get_response(self, dialect, body, sampling, session_id=None, turn=None, headers=None) -> vf.Response:
        env = self.episodes.get(session_id)
        if env is None:
            raise vf.ProviderError(f"no running episode has the session {session_id!r}", status_code=404)
        if turn is not None:
            prompt, tools = turn.prompt, turn.tools
        else:
            request = dialect.parse_request(body)
            prompt, tools = request.messages, request.tools
        content, calls = await env.model_call([message_to_wire(m) for m in prompt],
                                              [tool_to_wire(t) for t in tools] if tools else None)
        response = vf.Response(id=f"pipelinerl-{uuid.uuid4().hex[:12]}", created=0, model=body.get("model", ""),
                               message=vf.AssistantMessage(content=content, tool_calls=calls or None),
                               finish_reason="tool_calls" if calls else "stop")
        response.raw = serialize_completion(response, body.get("model", ""))
        return response


CLIENT = ActorClient()
_resolve_client = interception.resolve_client


def _client_for(config):
    """The interception server's client factory: ours for ACTOR_URL, verifiers' own for anything else (a
    judge's model, for example)."""
    return CLIENT if getattr(config, "base_url", None) == ACTOR_URL else _resolve_client(config)


interception.resolve_client = _client_for  # the one hook verifiers 0.4 has for a client instance
# verifiers finds a harness by id as `verifiers.v1.harnesses.<id>` or the top-level module `<id>` (no dotted path)
HARNESS_ID = "pipelinerl_chat"
sys.modules.setdefault(HARNESS_ID, verifiers_harness)


def model_context(model: str) -> vf.ModelContext:
    """The rollouts' model context: its client config selects ActorClient (sampling is ours, not verifiers')."""
    return vf.ModelContext(model=model, client=vf.TrainClientConfig(base_url=ACTOR_URL, api_key_var="PIPELINERL_"
                                                                                                  "UNUSED_KEY"))


def tool_specs(tools: Sequence[dict] | None) -> list[ToolSpec]:
    """The parser's view of the OpenAI function tools a rollout offers."""
    return [ToolSpec(f["function"]["name"], f["function"].get("description") or "",
                     f["function"].get("parameters") or {"type": "object", "properties": {}}) for f in tools or ()]


class VerifiersEnv(Environment):
    """One rollout of verifiers `task` in `env` (a served vf.Env), its model calls answered by our episode."""

    def __init__(self, env: vf.Env, task: vf.Task, ctx: vf.ModelContext, call_format: CallFormat,
                 serve: Callable[[], Awaitable[None]]):
        self.env, self.task, self.ctx, self.format = env, task, ctx, call_format
        self.serve = serve  # returns once `env` serves (its shared tool servers, its interception server)
        self.calls: asyncio.Queue[_Call | None] = asyncio.Queue()
        self.pending: _Call | None = None
        self.prompt: list[dict] = []
        self.rollout: asyncio.Task | None = None
        self.trace_ids: list[str] = []
        self.ended = False

    async def start(self) -> None:
        await self.serve()
        self.rollout = asyncio.create_task(self.env.run_episode(self.task, self.ctx, on_trace=self._minted))
        self.rollout.add_done_callback(lambda _: self.calls.put_nowait(None))
        self.pending = await self.calls.get()
        if self.pending is None:
            raise RuntimeError(f"the rollout ended before its first model call: {self._failure()}")
        self.prompt, self.tools = self.pending.messages, self.pending.tools

    def _minted(self, trace: vf.Trace) -> None:
        CLIENT.episodes[trace.id] = self
        self.trace_ids.append(trace.id)

    async def model_call(self, messages: list[dict], tools: list[dict] | None):
        """(content, tool calls) of the model's turn for this call of the rollout (ActorClient's)."""
        if self.ended:
            raise vf.ProviderError("the episode has ended (a limit of the trainer's episode)", status_code=409)
        call = _Call(messages, tools, asyncio.get_running_loop().create_future())
        self.calls.put_nowait(call)
        return await call.answer

    def messages(self) -> list[dict]:
        if self.prompt:
            return [dict(m) for m in self.prompt]
        return first_messages(self.task.data.system_prompt, self.task.data.prompt)  # start failed: its row's

    async def step(self, text: str) -> EnvReply:
        parsed = self.format.parse(text, tool_specs(self.tools)) if self.tools else []
        calls = [c for c in parsed if isinstance(c, ToolCall)]
        content = text
        for c in calls:
            content = content.replace(c.text, "", 1)
        self.pending.answer.set_result((content if content.strip() or not calls else None,
                                        [vf.ToolCall(id=f"call_{uuid.uuid4().hex[:12]}", name=c.name,
                                                     arguments=json.dumps(c.arguments)) for c in calls]))
        counts = {"tool_calls": len(parsed), "tool_errors": len(parsed) - len(calls)}
        asked, self.pending = self.pending, await self.calls.get()
        if self.pending is None:
            episode = await self.rollout
            if not episode.ok:
                raise RuntimeError(f"verifiers recorded the rollout as failed: {self._failure()}")
            trace = episode.traces[0]
            return EnvReply(done=True, reward=float(trace.reward or 0.0),
                            scores={name: r.score for name, r in trace.rewards.items() if r is not None}, **counts)
        return EnvReply(messages=self._new_messages(asked.messages), **counts)

    def _new_messages(self, before: list[dict]) -> list[dict]:
        """The messages the harness added after our last turn: the previous call's messages, our turn, then
        these (tool results, a user's reply)."""
        now = self.pending.messages
        if now[:len(before)] != before or len(now) <= len(before) + 1 or now[len(before)]["role"] != "assistant":
            raise RuntimeError("the harness's model call does not extend the conversation it sent before (an "
                               "earlier message edited or dropped): the episode cannot be continued token-exactly")
        new = now[len(before) + 1:]
        if any(m.get("role") not in MESSAGE_ROLES or not isinstance(m.get("content"), str) for m in new):
            raise RuntimeError(f"the harness added messages other than {MESSAGE_ROLES} with text after the "
                               f"model's turn: {str(new)[:300]}")
        return [{"role": m["role"], "content": m["content"]} for m in new]

    def _failure(self) -> str:
        """verifiers' errors of the rollout, or what ended it."""
        if self.rollout is None or not self.rollout.done():
            return "the rollout is still running"
        if self.rollout.cancelled():
            return "the rollout was cancelled"
        if self.rollout.exception() is not None:
            err = self.rollout.exception()
            return f"{type(err).__name__}: {err}"
        episode = self.rollout.result()
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        return "; ".join(f"{e.type}: {e.message}" for e in errors)[:2000] or "no error recorded"

    async def close(self) -> None:
        """End the rollout if our episode ended first (a limit): its parked call fails, so the harness stops;
        cancelled if verifiers has not wound it down within CLOSE_TIMEOUT_S."""
        self.ended = True
        try:
            if self.rollout is not None and not self.rollout.done():
                while self.pending is not None:
                    if not self.pending.answer.done():
                        self.pending.answer.set_exception(vf.ProviderError("the episode has ended (a limit of "
                                                                           "the trainer's episode)", status_code=409))
                    self.pending = await asyncio.wait_for(self.calls.get(), CLOSE_TIMEOUT_S)
                await asyncio.wait_for(asyncio.shield(self.rollout), CLOSE_TIMEOUT_S)
        except TimeoutError:
            self.rollout.cancel()
        finally:
            for trace_id in self.trace_ids:
                CLIENT.episodes.pop(trace_id, None)
