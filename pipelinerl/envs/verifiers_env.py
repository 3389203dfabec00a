"""A verifiers (v1) environment's rollout as one of our episodes, turn by turn.

verifiers runs a rollout itself: its harness (the chat loop: envs/verifiers_harness.py by default) sends each
model call to an interception server in this process, which asks a `vf.Client` for the reply; its task's
tools, stop conditions (`@vf.stop`), limits and rewards (`@vf.reward`) all act inside that rollout. Here the
client is `ActorClient`, which hands each call to the rollout's episode (envs/chat_program.py: a call parks until
our episode runner has sampled the model's turn on our servers, token-in/token-out). A `VerifiersEnv` episode is,
per turn:

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

import sys
import uuid
from collections.abc import Awaitable, Callable

import verifiers.v1 as vf
import verifiers.v1.interception.server as interception
from verifiers.v1.clients.train import serialize_completion, tool_to_wire
from verifiers.v1.dialects.chat import message_to_wire

from pipelinerl.envs import verifiers_harness
from pipelinerl.envs.chat_program import ChatProgramEnv, ProgramEnd
from pipelinerl.envs.tool_calls import CallFormat
from pipelinerl.envs.verifiers_harness import first_messages

ACTOR_URL = "http://pipelinerl.actor.invalid/v1"  # the client config that selects ActorClient (never dialled)


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
        calls = [vf.ToolCall(**c) for c in calls]
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


class VerifiersEnv(ChatProgramEnv):
    """One rollout of verifiers `task` in `env` (a served vf.Env), its model calls answered by our episode."""

    def __init__(self, env: vf.Env, task: vf.Task, ctx: vf.ModelContext, call_format: CallFormat,
                 serve: Callable[[], Awaitable[None]]):
        super().__init__(call_format)
        self.env, self.task, self.ctx = env, task, ctx
        self.serve = serve  # returns once `env` serves (its shared tool servers, its interception server)
        self.trace_ids: list[str] = []
        self.episode: vf.Episode | None = None  # verifiers' record of the rollout, once it ended

    async def start(self) -> None:
        await self.serve()
        await super().start()

    async def run_program(self) -> ProgramEnd:
        episode = self.episode = await self.env.run_episode(self.task, self.ctx, on_trace=self._minted)
        if not episode.ok:
            errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
            raise RuntimeError("verifiers recorded the rollout as failed: " + (
                "; ".join(f"{e.type}: {e.message}" for e in errors)[:2000] or "no error recorded"))
        trace = episode.traces[0]
        return ProgramEnd(float(trace.reward or 0.0),
                          {name: r.score for name, r in trace.rewards.items() if r is not None})

    def _minted(self, trace: vf.Trace) -> None:
        CLIENT.episodes[trace.id] = self
        self.trace_ids.append(trace.id)

    def opening_messages(self) -> list[dict]:
        return first_messages(self.task.data.system_prompt, self.task.data.prompt)

    def ended_error(self) -> Exception:
        return vf.ProviderError("the episode has ended (a limit of the trainer's episode)", status_code=409)

    async def close(self) -> None:
        """The rollout is wound down (ChatProgramEnv.close); no route to it is left."""
        try:
            await super().close()
        finally:
            for trace_id in self.trace_ids:
                CLIENT.episodes.pop(trace_id, None)
