"""Tasks: data sets and rewards. `get_task(cfg.task)` is the one way to build one."""

from __future__ import annotations

from pipelinerl.config import TaskConfig
from pipelinerl.tasks.base import PromptItem, Task


def get_task(cfg: TaskConfig) -> Task:
    """The task named by cfg.name, its splits built deterministically from cfg.seed."""
    # Imported here so that building the addition task never imports math-verify (and vice versa).
    if cfg.name == "addition":
        from pipelinerl.tasks.addition import AdditionTask

        return AdditionTask(cfg)
    if cfg.name == "math":
        from pipelinerl.tasks.math_task import MathTask

        return MathTask(cfg)
    raise ValueError(f"unknown task {cfg.name!r}; choose addition or math")


__all__ = ["PromptItem", "Task", "get_task"]
