"""An OpenEnv environment's episode as one of ours: one WebSocket session of its server per episode.

OpenEnv (`pip install -e '.[openenv]'`) serves an environment over WebSocket (`/ws`): `reset(seed, ...)` opens
an episode and returns an observation; `step(action)` returns the next observation with `reward` and `done`.
Here each episode is one session of `GenericEnvClient` (plain dicts, no environment package needed):

    start():     connect, reset(seed=<the item's seed>, **task.openenv.reset_args) -> the first message
    step(text):  step({task.openenv.action_field: text}) -> the observation's text as the next message, or,
                 once `done`, the end with the reward (the sum of every step's rewards)

An observation's text is its first non-empty string field of `task.openenv.observation_fields`. A session
that fails (the server dies or answers an error, a step past actor.episode.step_timeout_s) ends only its own
episode as an environment error (reward 0, counted), and the session is closed, never reused: OpenEnv hands
a timed-out step's late reply to the next message on the same connection.
"""

from __future__ import annotations

from openenv.core import GenericEnvClient

from pipelinerl.config.actor import OpenEnvConfig
from pipelinerl.envs.environment import Environment, EnvReply


def observation_text(observation: dict, fields: list[str]) -> str:
    """The first non-empty string among `fields` of an observation; a reset or step that shows the model
    nothing is the environment's error."""
    for name in fields:
        value = observation.get(name)
        if isinstance(value, str) and value:
            return value
    raise ValueError(f"the observation has no text in {fields} (task.openenv.observation_fields); its fields: "
                     f"{sorted(observation)[:20]}")


class OpenEnvEnv(Environment):
    """One episode: a session of the server at cfg.url, reset with `seed`."""

    def __init__(self, cfg: OpenEnvConfig, seed: int, message_timeout_s: float):
        self.cfg, self.seed = cfg, seed
        self.client = GenericEnvClient(base_url=cfg.url, connect_timeout_s=cfg.connect_timeout_s,
                                       message_timeout_s=message_timeout_s)
        self.first: str | None = None
        self.reward = 0.0

    async def start(self) -> None:
        result = await self.client.reset(seed=self.seed, **self.cfg.reset_args)
        if result.done:
            raise RuntimeError(f"the environment's reset (seed {self.seed}) ended the episode before any turn")
        self.first = observation_text(result.observation, self.cfg.observation_fields)

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.first or ""}]  # "": start failed, the episode ends after a turn

    async def step(self, text: str) -> EnvReply:
        result = await self.client.step({self.cfg.action_field: text})
        self.reward += float(result.reward or 0.0)
        if result.done:
            return EnvReply(done=True, reward=self.reward)
        return EnvReply(messages=[{"role": self.cfg.message_role,
                                   "content": observation_text(result.observation, self.cfg.observation_fields)}])

    async def close(self) -> None:
        await self.client.close()
