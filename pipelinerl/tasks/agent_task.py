"""A black-box agent on the OpenAI API as the task: `task.name=agent`, `task.agent.program=module:function` or
`task.agent.command=[argv]`.

The agent gets the items of a tiny task (`task.agent.items`) as `{"id", "prompt", "answer"}` and a client for the
actor's agent gateway (pipelinerl/envs/agent_gateway.py); every sample is one run of it, an episode whose model
turns are its chat completions, whose reward is what it returns (or posts to /rl/reward; with neither, the items'
task's own check of the last model turn it read). A command runs as a
process of its own per episode (any language: it reads the standard OPENAI_BASE_URL / OPENAI_API_KEY variables),
killed with its whole process group when its episode ends first or it runs past task.agent.max_wall_s.

The gateway serves on the actor's event loop from the first episode on, until `close()`.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import signal

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


def command_agent(argv: list[str]):
    """The agent that runs `argv` per episode (module doc): its reward is the last line it prints, a number, or
    `None` (posted instead); a non-zero exit raises with the end of its stderr."""
    async def agent(client_kwargs: dict, item: dict) -> float | None:
        env = {**os.environ, "OPENAI_BASE_URL": client_kwargs["base_url"], "OPENAI_API_KEY": client_kwargs["api_key"],
               "PIPELINERL_ITEM": json.dumps(item)}
        proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE, start_new_session=True)
        try:
            out, err = await proc.communicate()
        finally:
            if proc.returncode is None:  # cancelled: its episode ended first, or past max_wall_s
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        if proc.returncode != 0:
            raise RuntimeError(f"the agent command exited with code {proc.returncode}: "
                               f"{err.decode(errors='replace')[-500:]}")
        last = next((line.strip() for line in reversed(out.decode(errors="replace").splitlines()) if line.strip()), "")
        if last == "None":
            return None
        try:
            return float(last)
        except ValueError:
            raise RuntimeError(f"the agent command's last line must be its reward (a number, or None), got "
                               f"{last[:200]!r}") from None
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
        self.agent = load_agent(a.program) if a.program else command_agent(a.command)
        self.format = call_format(a.tool_format)
        source = _item_source(a.items)(TaskConfig(name=a.items, seed=cfg.seed, eval_fraction=cfg.eval_fraction))
        super().__init__(source.train_items, source.eval_items, cfg.seed)
        self.source = source  # its check scores an agent that returns no reward
        self.gateway = Gateway()

    def environment(self, item: PromptItem):
        from pipelinerl.envs.agent_gateway import AgentEnv

        return AgentEnv(self.gateway, self.agent, {"id": item.id, "prompt": item.prompt, "answer": item.answer},
                        self.format, self.agent_cfg.max_wall_s,
                        check=lambda text: self.source.reward(item, text, finished=True))

    def reward(self, item: PromptItem, completion_text: str, finished: bool, *, num_tokens: int | None = None,
               max_new_tokens: int | None = None) -> float:
        raise NotImplementedError("an agent task's samples are episodes: the agent's returned reward scores them")

    def close(self) -> None:
        """Stop the gateway, on the loop that served it, which the actor has stopped running by now."""
        loop = self.gateway.loop
        if loop is not None and not loop.is_closed() and not loop.is_running():
            loop.run_until_complete(self.gateway.stop())
