"""Tasks: data sets and rewards. `get_task(cfg.task)` is the one way to build one."""

from __future__ import annotations

from pipelinerl.config import TaskConfig
from pipelinerl.tasks.base import PromptItem, Task


def task_class(name: str) -> type[Task]:
    """The Task subclass named `name` (`task.name` in the config), for its class attributes without
    building its data set."""
    # Imported here so that building the addition task never imports math-verify (and vice versa).
    if name == "addition":
        from pipelinerl.tasks.addition import AdditionTask

        return AdditionTask
    if name == "math":
        from pipelinerl.tasks.math_task import MathTask

        return MathTask
    if name == "math_tir":
        from pipelinerl.tasks.math_tir import MathTirTask

        return MathTirTask
    if name == "arithmetic":
        from pipelinerl.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask
    if name == "tool_sums":
        from pipelinerl.tasks.tool_sums import ToolSumsTask

        return ToolSumsTask
    if name == "instructions":
        from pipelinerl.tasks.instructions import InstructionsTask

        return InstructionsTask
    if name == "verifiers":
        from pipelinerl.tasks.verifiers_task import VerifiersTask

        return VerifiersTask
    if name == "openenv":
        from pipelinerl.tasks.openenv_task import OpenEnvTask

        return OpenEnvTask
    if name == "agent":
        from pipelinerl.tasks.agent_task import AgentTask

        return AgentTask
    raise ValueError(f"unknown task {name!r}; choose addition, arithmetic, math, math_tir, tool_sums, instructions, "
                     "verifiers, openenv or agent")


def get_task(cfg: TaskConfig, run_dir: str | None = None) -> Task:
    """The task named by cfg.name, its splits built deterministically from cfg.seed; `run_dir`: the run's
    directory (Task.run_dir), where the openenv task finds the environment servers the launcher started."""
    task = task_class(cfg.name)(cfg)
    task.run_dir = run_dir
    return task


__all__ = ["PromptItem", "Task", "get_task", "task_class"]
