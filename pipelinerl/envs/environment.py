"""The environment contract of a multi-turn episode.

A task that trains episodes builds one `Environment` per episode from a data item. The runner
(pipelinerl/envs/runner.py) asks it for the initial chat messages, then alternates: a model turn (the
servers' completion of the episode's tokens so far), then `step(text)`, the environment's answer to that
turn's text: more messages (tool results, which the chat template renders as the next turn's context), or
the end of the episode with its reward. `step` may be slow (a sandboxed script): it is awaited, and many
episodes run at once on the actor's event loop, so blocking work belongs on a thread
(`asyncio.to_thread`) or in a process pool such as the Python sandbox's.

An environment that must reach something before its first message (a rollout of another framework, a
server) does it in `start()`, awaited once before `messages()`.

What an environment may not do is stop the actor: a `start` or `step` that raises, runs past its timeout or
returns anything but an `EnvReply` with well-formed messages ends only its own episode, with reward 0 and end
reason "env_error" (runner.py logs the reason and the actor counts it). A failed `start` still lets the model
take its first turn (every episode row holds one), then ends the episode.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

MESSAGE_ROLES = ("user", "tool")  # what an environment may answer with (the assistant's turns are the model's)
BRANCH_ROLES = ("assistant", "system")  # what a branch may render again as well (EnvReply.keep_messages)


@dataclass(frozen=True)
class EnvReply:
    """The environment's answer to one model turn: `messages` to continue with, or `done` with `reward`.
    `tool_calls` / `tool_errors`: the calls the turn made and how many of them failed (malformed, unknown
    tool, refused input), counted per episode in the stream and in TensorBoard. `scores`: with `done`, the
    reward's parts by name (an environment with several reward functions), each logged as its mean.
    `keep_messages`: a program that went back in its conversation (an agent that retried a turn or edited its
    history): the episode continues from its first `keep_messages` messages, then `messages` (which may then be
    empty, or hold assistant and system messages: rendered, not trained); with `done`, the model turns after them
    are not trained (episode.py's branches)."""

    messages: Sequence[dict] = field(default_factory=tuple)
    done: bool = False
    reward: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    scores: Mapping[str, float] = field(default_factory=dict)
    keep_messages: int | None = None


class Environment(abc.ABC):
    """One episode's environment. `tools`: the chat template's `tools` argument (Toolbox.template_tools),
    rendered at every turn; None when the template should not list any. `raw_text`: the messages are plain text
    joined as it is, no chat template (episode.py's raw mode; read once `start` has returned). `stop`: strings
    that end the next model turn besides its end token (the server's `stop`; read before each turn)."""

    tools: list[dict] | None = None
    raw_text: bool = False
    stop: tuple[str, ...] = ()

    async def start(self) -> None:  # noqa: B027 - a hook: only environments that reach something override it
        """Prepare the episode; awaited once, before `messages()` and `tools` are read."""

    @abc.abstractmethod
    def messages(self) -> list[dict]:
        """The episode's initial chat messages (a system prompt, the task's user message)."""

    @abc.abstractmethod
    async def step(self, text: str) -> EnvReply:
        """The answer to a model turn whose content (decoded without its end token) is `text`."""

    async def close(self) -> None:  # noqa: B027 - a hook: only environments holding resources override it
        """Release what this episode holds; called once, however the episode ended."""


def reply_problem(reply: object) -> str | None:
    """Why `reply` is not a usable EnvReply (the runner's check of what `step` returned), or None."""
    if not isinstance(reply, EnvReply):
        return f"step() returned {type(reply).__name__}, not an EnvReply"
    if isinstance(reply.reward, bool) or not isinstance(reply.reward, (int, float)) or not math.isfinite(reply.reward):
        return f"the reward must be a finite number, got {reply.reward!r}"
    for name in ("tool_calls", "tool_errors"):
        value = getattr(reply, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"{name} must be a count (an int >= 0), got {value!r}"
    if reply.tool_errors > reply.tool_calls:
        return f"{reply.tool_errors} tool errors but only {reply.tool_calls} tool calls"
    if not isinstance(reply.scores, Mapping) or not all(
            isinstance(k, str) and not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
            for k, v in reply.scores.items()):
        return f"scores must map names to finite numbers, got {str(reply.scores)[:200]}"
    branch = reply.keep_messages is not None
    if branch and (isinstance(reply.keep_messages, bool) or not isinstance(reply.keep_messages, int)
                   or reply.keep_messages < 0):
        return f"keep_messages must be a message count (an int >= 0), got {reply.keep_messages!r}"
    if reply.done:
        return None
    if isinstance(reply.messages, (str, bytes)) or not isinstance(reply.messages, Sequence):
        return "messages must be a sequence of message dicts"
    if not reply.messages and not branch:
        return "a reply that does not end the episode needs at least one message"
    roles = MESSAGE_ROLES + BRANCH_ROLES if branch else MESSAGE_ROLES
    for m in reply.messages:
        if not isinstance(m, dict) or m.get("role") not in roles or not isinstance(m.get("content"), str):
            return f"every message must be a dict with a role in {roles} and a string content, got {str(m)[:200]}"
    return None
