"""A verifiers (v1) environment as the task: `task.name=verifiers`, `task.verifiers.env=<taskset id>`.

verifiers (`pip install -e '.[verifiers]'`) loads the taskset module the config names (one vf.Taskset
subclass in its `__all__`), with `task.verifiers.args` as its config fields. Its rows are this task's items
(ids: the row's own `id`, else `<env>:<row number>`); the held-out items are the rows of the same taskset
with `task.verifiers.eval_args` over the args (a test split), or `task.eval_fraction` of the training rows.
Every sample is an episode of envs/verifiers_env.py: verifiers' rollout of the row, with its tools, stop
conditions and reward functions, whose model turns our servers sample; the reward is the rollout's
(the weighted sum of its reward functions), each function's score logged as actor/episode/score/<name>.

The environment serves (its shared tool servers, its interception server) from the first episode on, on the
actor's event loop, until `close()`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from contextlib import AsyncExitStack

from pipelinerl.config import TaskConfig
from pipelinerl.envs.tool_calls import call_format
from pipelinerl.tasks.base import PromptItem, Task, add_import_path, split_held_out

# A line per rollout (verifiers) and per HTTP request (its interception server, the harness's MCP clients) at
# INFO: thousands a step. Their warnings and errors still show, but for the interception server's warning on each
# model call refused because our episode had ended (a limit: counted as a truncation in actor/episode/*).
QUIET_LOGGERS = {"verifiers": logging.WARNING, "aiohttp.access": logging.WARNING, "httpx2": logging.WARNING,
                 "mcp": logging.WARNING, "verifiers.v1.interception.server": logging.ERROR}


def _import_verifiers():
    try:
        import verifiers.v1 as vf
    except ImportError as err:
        raise ImportError("task.name=verifiers needs the verifiers package: pip install -e '.[verifiers]'") from err
    return vf


def _prompt_text(prompt) -> str:
    """A row's prompt as one line of text for logs (its last message's text when it is messages)."""
    if isinstance(prompt, str) or prompt is None:
        return prompt or ""
    content = getattr(prompt[-1], "content", "") if prompt else ""
    return content if isinstance(content, str) else str(content)


class VerifiersTask(Task):
    name = "verifiers"
    multi_turn = True

    def __init__(self, cfg: TaskConfig):
        vf = _import_verifiers()
        from pipelinerl.envs import verifiers_env, verifiers_judge  # noqa: F401 -- installs the judge route

        for name, level in QUIET_LOGGERS.items():
            logging.getLogger(name).setLevel(level)
        v = cfg.verifiers
        if v.path:
            add_import_path(v.path, "task.verifiers.path")
        self.vf_cfg, self.format = v, call_format(v.tool_format)
        self.env = vf.load_environment(vf.resolve_env_config({
            "taskset": {"id": v.env, **v.args},
            "agent": {"harness": {"id": v.harness}, "runtime": {"type": "subprocess"}}}))
        self.ctx = verifiers_env.model_context("policy")
        self.rows: dict[str, object] = {}
        items = self._items(self.env.taskset)
        if v.eval_args is None:
            train_items, eval_items = split_held_out(items, cfg.eval_fraction, cfg.seed)
        else:
            held_out = vf.load_taskset(vf.taskset_config_type(v.env)(id=v.env, **{**v.args, **v.eval_args}))
            train_items, eval_items = items, self._items(held_out)
        super().__init__(train_items, eval_items, cfg.seed)
        self._stack: AsyncExitStack | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = asyncio.Lock()

    def _items(self, taskset) -> list[PromptItem]:
        """The taskset's rows (at most task.verifiers.max_rows) as items; each row's vf.Task kept by id."""
        items = []
        for row in itertools.islice(taskset, self.vf_cfg.max_rows):
            data = row.data
            item = PromptItem(id=data.id or f"{self.vf_cfg.env}:{data.idx}", prompt=_prompt_text(data.prompt),
                              answer=str(getattr(data, "answer", "") or ""))
            if self.rows.setdefault(item.id, row) is not row:
                raise ValueError(f"task.verifiers.env {self.vf_cfg.env!r}: two rows have the id {item.id!r}")
            items.append(item)
        return items

    async def serve(self) -> None:
        """Enter the environment's serving context once, on the calling (the actor's) event loop."""
        async with self._lock:
            if self._stack is None:
                stack = AsyncExitStack()
                await stack.enter_async_context(self.env.serving())
                self._stack, self._loop = stack, asyncio.get_running_loop()

    def use_servers(self, client, http) -> None:
        """The environment's judges at JUDGE_URL go to the run's judge servers (envs/verifiers_judge.py)."""
        from pipelinerl.envs.verifiers_judge import ROUTE

        ROUTE.use(client, http)

    def environment(self, item: PromptItem):
        from pipelinerl.envs.verifiers_env import VerifiersEnv

        return VerifiersEnv(self.env, self.rows[item.id], self.ctx, self.format, self.serve)

    def reward(self, item: PromptItem, completion_text: str, finished: bool, *, num_tokens: int | None = None,
               max_new_tokens: int | None = None) -> float:
        raise NotImplementedError("a verifiers task's samples are episodes: verifiers' reward functions score them")

    async def stop_serving(self) -> None:
        """Leave the serving context (its tool servers stop); the next episode serves again."""
        if self._stack is not None:
            from pipelinerl.envs.verifiers_harness import close_connections

            stack, self._stack, self._loop = self._stack, None, None
            await close_connections()
            await stack.aclose()

    def close(self) -> None:
        """stop_serving on the loop that started serving, which the actor has stopped running by now."""
        loop = self._loop
        if loop is not None and not loop.is_closed() and not loop.is_running():
            loop.run_until_complete(self.stop_serving())
