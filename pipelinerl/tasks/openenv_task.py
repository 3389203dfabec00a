"""An OpenEnv environment server as the task: `task.name=openenv`, with `task.openenv.url=http://host:port` (a
server you run) or `task.openenv.serve=module:app` (servers the launcher runs: envs/openenv_server.py).

OpenEnv environments draw their own problems at `reset(seed)`, so the items are seeds: training items
`seed-0 .. seed-<num_items - 1>`, held-out items from `task.openenv.eval_seed_start` on. Every sample is an
episode of envs/openenv_env.py (one session of a server); its reward is the sum of the episode's step rewards.
"""

from __future__ import annotations

import functools

from pipelinerl.config import TaskConfig
from pipelinerl.tasks.base import PromptItem, Task


def _items(seeds: range) -> list[PromptItem]:
    return [PromptItem(id=f"seed-{s}", prompt=f"reset(seed={s})", answer="") for s in seeds]


class OpenEnvTask(Task):
    name = "openenv"
    multi_turn = True

    def __init__(self, cfg: TaskConfig):
        try:
            import openenv.core  # noqa: F401 -- the extra's check, before any episode
        except ImportError as err:
            raise ImportError("task.name=openenv needs openenv-core: pip install -e '.[openenv]'") from err
        o = self.openenv = cfg.openenv
        super().__init__(_items(range(o.num_items)),
                         _items(range(o.eval_seed_start, o.eval_seed_start + o.num_eval_items)), cfg.seed)

    @functools.cached_property
    def servers(self):
        """Where the episodes' sessions go (envs/openenv_env.py's EnvServers), built at the first episode:
        get_task sets run_dir after __init__."""
        from pipelinerl.envs.openenv_env import EnvServers

        return EnvServers(self.openenv.url, self.run_dir, self.openenv.connect_timeout_s)

    def environment(self, item: PromptItem):
        from pipelinerl.envs.openenv_env import OpenEnvEnv

        return OpenEnvEnv(self.openenv, int(item.id.removeprefix("seed-")), self.openenv.message_timeout_s,
                          self.servers)

    def reward(self, item: PromptItem, completion_text: str, finished: bool, *, num_tokens: int | None = None,
               max_new_tokens: int | None = None) -> float:
        raise NotImplementedError("an openenv task's samples are episodes: the environment's step rewards score them")
