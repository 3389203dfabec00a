"""Run one multi-turn episode: model turns from the servers, answers from its environment.

    await env.start(); episode = Episode(tokenizer, env.messages(), limits, tools=env.tools)
    loop: completion of episode.prefix()  ->  add_model_turn  ->  env.step(turn text)
          -> done (reward) | add_env_turn(messages) | branch(keep_messages, messages) | a limit ends it
             (truncated, reward 0)

Every call continues the episode's exact token prefix, so a weight update that lands between (or
during) turns costs nothing: the servers keep every running sequence, and the episode's model tokens
simply carry the versions that produced them. Environment failures end only this episode
(environment.py): reward 0, end reason "env_error", the reason in `EpisodeResult.error`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from pipelinerl.envs.environment import Environment, EnvReply, reply_problem
from pipelinerl.envs.episode import Episode, EpisodeLimits

log = logging.getLogger(__name__)

ENV_ERROR = "env_error"  # the end reason of an episode whose environment failed


class Sampled(Protocol):
    """What a server call returns (actor/client.py's Completion has these)."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finished: bool


# (the token ids to continue, the call's max_tokens) -> one sampled completion; an environment with stop strings
# (Environment.stop) has them passed as the keyword `stop` (a tuple), so only its callers need to take it
Generate = Callable[..., Awaitable[Sampled]]


@dataclass
class EpisodeResult:
    episode: Episode
    reward: float
    tool_calls: int = 0
    tool_errors: int = 0
    error: str | None = None  # why the environment failed (end_reason is then ENV_ERROR)
    scores: dict[str, float] = field(default_factory=dict)  # the reward's parts by name (EnvReply.scores)
    drift_tokens: int = 0  # model tokens a branch took out of the training (EnvReply.keep_messages)

    @property
    def end_reason(self) -> str:
        return ENV_ERROR if self.error is not None else str(self.episode.end_reason)


async def run_episode(generate: Generate, env: Environment, tokenizer, limits: EpisodeLimits,
                      step_timeout_s: float, name: str = "episode") -> EpisodeResult:
    """Run `env`'s episode to its end; `step_timeout_s` bounds each `env.step`. `name` goes into the log
    line of a failure. Server errors (after the client's retries) propagate, as for single-turn groups."""
    try:
        start_error = await _start(env, step_timeout_s)
        episode = Episode(tokenizer, env.messages(), limits, tools=env.tools, raw=env.raw_text)
        result = EpisodeResult(episode, 0.0)
        while True:
            stop = tuple(env.stop)
            sampled = await (generate(episode.prefix(), episode.max_new_tokens(), stop=stop) if stop
                             else generate(episode.prefix(), episode.max_new_tokens()))
            turn = episode.add_model_turn(sampled.token_ids, sampled.logprobs, sampled.versions, sampled.finished)
            if episode.done:  # cut at a token limit: truncated, reward 0
                return result
            reply, error = (None, start_error) if start_error else await _step(env, turn.text, step_timeout_s)
            if error is not None:
                log.warning("%s: the environment failed at turn %d (the episode ends with reward 0): %s", name,
                            len(episode.model_turns), error)
                result.error = error
                return result
            result.tool_calls += reply.tool_calls
            result.tool_errors += reply.tool_errors
            if reply.done:
                if reply.keep_messages is not None:
                    result.drift_tokens += episode.mask_after(reply.keep_messages)
                episode.finish()
                result.reward = float(reply.reward)
                result.scores = {k: float(v) for k, v in reply.scores.items()}
                return result
            if reply.keep_messages is None:
                appended = episode.add_env_turn(reply.messages)
            else:
                try:
                    drift, appended = episode.branch(reply.keep_messages, reply.messages)
                except ValueError as err:
                    log.warning("%s: the program's branch cannot be continued (the episode ends with reward 0): %s",
                                name, err)
                    result.error = f"the program's branch cannot be continued: {err}"
                    return result
                result.drift_tokens += drift
            if appended is None:  # max_turns / max_total_tokens: truncated
                return result
    finally:
        await _close(env, name)


async def _start(env: Environment, timeout_s: float) -> str | None:
    """None, or why `env.start()` failed."""
    try:
        await asyncio.wait_for(env.start(), timeout_s)
    except TimeoutError:
        return f"start() ran past its timeout of {timeout_s:g} s"
    except Exception as err:  # noqa: BLE001 -- any failure of the environment ends only its episode
        return f"start() raised {type(err).__name__}: {err}"
    return None


async def _step(env: Environment, text: str, timeout_s: float) -> tuple[EnvReply | None, str | None]:
    """(the reply, None), or (None, why it is unusable)."""
    try:
        reply = await asyncio.wait_for(env.step(text), timeout_s)
    except TimeoutError:
        return None, f"step() ran past its timeout of {timeout_s:g} s"
    except Exception as err:  # noqa: BLE001 -- any failure of the environment ends only its episode
        return None, f"step() raised {type(err).__name__}: {err}"
    problem = reply_problem(reply)
    return (None, problem) if problem else (reply, None)


async def _close(env: Environment, name: str) -> None:
    try:
        await env.close()
    except Exception as err:  # noqa: BLE001 -- the episode's result stands
        log.warning("%s: the environment's close() raised %s: %s", name, type(err).__name__, err)
