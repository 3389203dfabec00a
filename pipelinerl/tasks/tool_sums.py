"""Sums of three 3-digit numbers with a calculator, for the tiny model: a multi-turn task.

A prompt `123+456+789=` is beyond what the tiny model computes in its head; with the calculator it is a
copy. The compact call format (envs/tool_calls.py) fits the tiny alphabet: the model writes
`==123+456+789=` and ends its turn; the environment answers `1368` as a tool message, which the tiny
template renders as is; the model writes `1368` and ends; that turn, holding no call, is its answer:

    BOS 123+456+789= | ==123+456+789= EOS | 1368 | 1368 EOS
      prompt          model turn 1         tool   model turn 2 (the answer: reward 1)

A turn without a call is the final answer (reward 1 for the exact sum, else 0); a failed call (malformed,
refused by the calculator) is answered with `*`, and the episode goes on until actor.episode.max_turns.
"""

from __future__ import annotations

import random

from pipelinerl.config import TaskConfig
from pipelinerl.envs.environment import Environment, EnvReply
from pipelinerl.envs.episode import EpisodeLimits
from pipelinerl.envs.tool_calls import COMPACT_CLOSE, COMPACT_OPEN, call_format
from pipelinerl.envs.toolbox import Toolbox, calculator_tool
from pipelinerl.tasks.base import PromptItem, Task, split_held_out

TERMS, LOW, HIGH = 3, 100, 999
NUM_ITEMS = 20_000  # distinct prompts drawn (of 900^3); the held-out split is task.eval_fraction of them


class ToolSumsEnv(Environment):
    """One episode: the compact calculator, then the answer."""

    def __init__(self, item: PromptItem):
        self.item, self.toolbox, self.format = item, Toolbox([calculator_tool()]), call_format("compact")

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.item.prompt}]

    async def step(self, text: str) -> EnvReply:
        calls = self.format.parse(text, self.toolbox.specs)
        if not calls:
            return EnvReply(done=True, reward=1.0 if text == self.item.answer else 0.0)
        answers = await self.toolbox.answer_all(calls)
        return EnvReply(messages=[{"role": "tool", "content": self.format.reply(a.text, a.ok)} for a in answers],
                        tool_calls=len(answers), tool_errors=sum(not a.ok for a in answers))


class ToolSumsTask(Task):
    name = "tool_sums"
    multi_turn = True
    reports_greedy_success = True  # greedy episodes of the tiny model, batched turn by turn: seconds
    episode_limits = EpisodeLimits(max_turns=3, max_tokens_per_turn=20, max_total_tokens=96)

    def __init__(self, cfg: TaskConfig):
        rng, seen, items = random.Random(f"tool_sums/{cfg.seed}"), set(), []
        while len(items) < NUM_ITEMS:
            terms = tuple(rng.randint(LOW, HIGH) for _ in range(TERMS))
            if terms not in seen:
                seen.add(terms)
                items.append(PromptItem(id="+".join(map(str, terms)), prompt="+".join(map(str, terms)) + "=",
                                        answer=str(sum(terms))))
        train_items, eval_items = split_held_out(items, cfg.eval_fraction, cfg.seed)
        super().__init__(train_items, eval_items, cfg.seed)

    def environment(self, item: PromptItem) -> ToolSumsEnv:
        return ToolSumsEnv(item)

    def demonstration(self, item: PromptItem) -> list[str]:
        """One call of the whole sum, then its result copied."""
        return [f"{COMPACT_OPEN}{item.prompt[:-1]}{COMPACT_CLOSE}", item.answer]

    def reward(self, item: PromptItem, completion_text: str, finished: bool, *, num_tokens: int | None = None,
               max_new_tokens: int | None = None) -> float:
        """A single completion answering without the calculator: 1 for the exact sum followed by EOS."""
        return 1.0 if finished and completion_text == item.answer else 0.0
