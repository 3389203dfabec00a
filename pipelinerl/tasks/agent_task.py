"""A black-box agent on the OpenAI API as the task: `task.name=agent`, `task.agent.program=module:function`.

The agent gets the items of a tiny task (`task.agent.items`) as `{"id", "prompt", "answer"}` and a client for the
actor's agent gateway (pipelinerl/envs/agent_gateway.py); every sample is one run of it, an episode whose model
turns are its chat completions, whose reward is what it returns (or posts to /rl/reward).

The gateway serves on the actor's event loop from the first episode on, until `close()`.
"""

from __future__ import annotations

import importlib

from pipelinerl.config import TaskConfig
from pipelinerl.envs.tool_calls import call_format
from pipelinerl.tasks.base import PromptItem, Task, add_import_path


def load_agent(program: str):
    """The callable named `module:function`."""
    module, _, name = program.partition(":")
    agent = getattr(importlib.import_module(module), name, None)
    if not callable(agent):
        raise ValueError(f"task.agent.program: {module} has no callable {name!r}")
    return agent


def _item_source(name: str) -> type[Task]:
    """The tiny task whose items the agent gets (task.agent.items)."""
    if name == "addition":
        from pipelinerl.tasks.addition import AdditionTask

        return AdditionTask
    if name == "arithmetic":
        from pipelinerl.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask
    from pipelinerl.tasks.tool_sums import ToolSumsTask

    return ToolSumsTask


class AgentTask(Task):
    name = "agent"
    multi_turn = True

    def __init__(self, cfg: TaskConfig):
        from pipelinerl.envs.agent_gateway import Gateway

        a = self.agent_cfg = cfg.agent
        if a.path:
            add_import_path(a.path, "task.agent.path")
        self.agent, self.format = load_agent(a.program), call_format(a.tool_format)
        source = _item_source(a.items)(TaskConfig(name=a.items, seed=cfg.seed, eval_fraction=cfg.eval_fraction))
        super().__init__(source.train_items, source.eval_items, cfg.seed)
        self.gateway = Gateway()

    def environment(self, item: PromptItem):
        from pipelinerl.envs.agent_gateway import AgentEnv

        return AgentEnv(self.gateway, self.agent, {"id": item.id, "prompt": item.prompt, "answer": item.answer},
                        self.format, self.agent_cfg.max_wall_s)

    def reward(self, item: PromptItem, completion_text: str, finished: bool, *, num_tokens: int | None = None,
               max_new_tokens: int | None = None) -> float:
        raise NotImplementedError("an agent task's samples are episodes: the agent's returned reward scores them")

    def close(self) -> None:
        """Stop the gateway, on the loop that served it, which the actor has stopped running by now."""
        loop = self.gateway.loop
        if loop is not None and not loop.is_closed() and not loop.is_running():
            loop.run_until_complete(self.gateway.stop())
