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

The server of a session (`EnvServers`): task.openenv.url, or with task.openenv.serve one of the servers the
launcher started, as announced in RUN_DIR/openenv_servers/ when the episode starts: a restarted server takes new
sessions once it has announced itself again.
"""

from __future__ import annotations

import asyncio
import time

from openenv.core import GenericEnvClient

from pipelinerl.config.actor import OpenEnvConfig
from pipelinerl.envs.environment import Environment, EnvReply
from pipelinerl.rundir import OPENENV_SERVERS_DIR, list_servers

POLL_S = 0.2  # while no server is announced, the folder is read again this often


def observation_text(observation: dict, fields: list[str]) -> str:
    """The first non-empty string among `fields` of an observation; a reset or step that shows the model
    nothing is the environment's error."""
    for name in fields:
        value = observation.get(name)
        if isinstance(value, str) and value:
            return value
    raise ValueError(f"the observation has no text in {fields} (task.openenv.observation_fields); its fields: "
                     f"{sorted(observation)[:20]}")


class EnvServers:
    """Where each episode's session goes: `url` (task.openenv.url) when given; else the servers announced in
    RUN_DIR/openenv_servers/ of `run_dir` at the episode's start, the one with the fewest sessions of this
    process open (ties: the first by URL, so sessions go round the servers). With none announced, an episode
    waits up to `wait_s` for one (a server restarting), then fails (an environment error)."""

    def __init__(self, url: str | None, run_dir: str | None, wait_s: float):
        if url is None and run_dir is None:
            raise ValueError("task.openenv.serve: the environment servers are found in the run directory; build the "
                             "task with get_task(cfg.task, cfg.run_dir)")
        self.url, self.run_dir, self.wait_s = url, run_dir, wait_s
        self.open: dict[str, int] = {}  # announced server -> its sessions open (acquired, not yet released)

    async def acquire(self) -> str:
        """The server of a new session; `release` it when the session ends."""
        if self.url is not None:
            return self.url
        deadline = time.monotonic() + self.wait_s
        while not (urls := list_servers(self.run_dir, OPENENV_SERVERS_DIR)):
            if time.monotonic() >= deadline:
                raise RuntimeError(f"no OpenEnv environment server announced in {self.run_dir}/{OPENENV_SERVERS_DIR} "
                                   f"for {self.wait_s:g} s (task.openenv.connect_timeout_s); see the launcher's "
                                   "log and logs/openenv*.log")
            await asyncio.sleep(POLL_S)
        url = min(urls, key=lambda u: self.open.get(u, 0))
        self.open[url] = self.open.get(url, 0) + 1
        return url

    def release(self, url: str) -> None:
        if self.url is None:
            self.open[url] -= 1
            if not self.open[url]:
                del self.open[url]


class OpenEnvEnv(Environment):
    """One episode: a session of a server of `servers`, reset with `seed`."""

    def __init__(self, cfg: OpenEnvConfig, seed: int, message_timeout_s: float, servers: EnvServers):
        self.cfg, self.seed, self.servers, self.message_timeout_s = cfg, seed, servers, message_timeout_s
        self.url: str | None = None  # the session's server, once acquired
        self.client: GenericEnvClient | None = None
        self.first: str | None = None
        self.reward = 0.0

    async def start(self) -> None:
        self.url = await self.servers.acquire()
        self.client = GenericEnvClient(base_url=self.url, connect_timeout_s=self.cfg.connect_timeout_s,
                                       message_timeout_s=self.message_timeout_s)
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
        if self.url is None:  # start() failed before a server was found: no session
            return
        self.servers.release(self.url)
        if self.client is not None:
            await self.client.close()
