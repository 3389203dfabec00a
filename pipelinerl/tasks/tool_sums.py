"""Sums of three 3-digit numbers with a calculator, for the tiny model: a multi-turn task.

A prompt `123+456+789=` is beyond what the tiny model computes in its head; with the calculator it is a
copy. The compact call format (envs/tool_calls.py) fits the tiny alphabet: the model writes
`==123+456+789=` and ends its turn; the environment answers `1368` as a tool message, which the tiny
template renders as is; the model writes `1368` and ends; that turn, holding no call, is its answer:

    BOS 123+456+789= | ==123+456+789= EOS | 1368 | 1368 EOS
      prompt          model turn 1         tool   model turn 2 (the answer: reward 1)

A turn without a call is the final answer (reward 1 for the exact sum, else 0); a failed call (malformed,
refused by the calculator) is answered with `*`, and the episode goes on until actor.episode.max_turns.

Slow and long-tailed (task.tool_sums): an item's calculator may first answer BUSY some k times, k drawn once per
item (`busy_calls`), so the model must call again (the demonstration does: k + 1 calls, then the answer); every
call may wait up to latency_s. Episodes then take 2 to max_busy + 2 turns and seconds of tool time, as agentic
episodes do, which is where generating while the trainer trains pays off most.
"""

from __future__ import annotations

import asyncio
import random

from pipelinerl.config import TaskConfig
from pipelinerl.envs.environment import Environment, EnvReply
from pipelinerl.envs.episode import EpisodeLimits
from pipelinerl.envs.tool_calls import COMPACT_CLOSE, COMPACT_OPEN, call_format
from pipelinerl.envs.toolbox import Toolbox, calculator_tool
from pipelinerl.tasks.base import PromptItem, Task, split_held_out

TERMS, LOW, HIGH = 3, 100, 999
NUM_ITEMS = 20_000  # distinct prompts drawn (of 900^3); the held-out split is task.eval_fraction of them
BUSY = "-"  # the busy calculator's answer: call again


def busy_calls(item: PromptItem, max_busy: int) -> int:
    """How many calls of `item` the calculator answers BUSY first: geometric (each one more with probability 1/2),
    at most max_busy, the same on every episode and actor (seeded by the item's id)."""
    rng, k = random.Random(f"tool_sums/busy/{item.id}"), 0
    while k < max_busy and rng.random() < 0.5:
        k += 1
    return k


class ToolSumsEnv(Environment):
    """One episode: the compact calculator (busy its first `busy` calls, each call delayed up to `latency_s`), then
    the answer."""

    def __init__(self, item: PromptItem, busy: int = 0, latency_s: float = 0.0):
        self.item, self.toolbox, self.format = item, Toolbox([calculator_tool()]), call_format("compact")
        self.busy, self.latency_s = busy, latency_s

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.item.prompt}]

    async def step(self, text: str) -> EnvReply:
        calls = self.format.parse(text, self.toolbox.specs)
        if not calls:
            return EnvReply(done=True, reward=1.0 if text == self.item.answer else 0.0)
        if self.latency_s:
            await asyncio.sleep(random.uniform(0.0, self.latency_s))
        if self.busy:
            self.busy -= 1
            return EnvReply(messages=[{"role": "tool", "content": BUSY}], tool_calls=len(calls))
        answers = await self.toolbox.answer_all(calls)
        return EnvReply(messages=[{"role": "tool", "content": self.format.reply(a.text, a.ok)} for a in answers],
                        tool_calls=len(answers), tool_errors=sum(not a.ok for a in answers))


class ToolSumsTask(Task):
    name = "tool_sums"
    multi_turn = True
    reports_greedy_success = True  # greedy episodes of the tiny model, batched turn by turn: seconds

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
        self.max_busy, self.latency_s = cfg.tool_sums.max_busy, cfg.tool_sums.latency_s
        # each busy answer costs a call (15 tokens and EOS) and the `-`
        self.episode_limits = EpisodeLimits(max_turns=3 + self.max_busy, max_tokens_per_turn=20,
                                            max_total_tokens=96 + 17 * self.max_busy)

    def environment(self, item: PromptItem) -> ToolSumsEnv:
        return ToolSumsEnv(item, busy_calls(item, self.max_busy), self.latency_s)

    def demonstration(self, item: PromptItem) -> list[str]:
        """One call of the whole sum (again while the calculator is busy), then its result copied."""
        return [f"{COMPACT_OPEN}{item.prompt[:-1]}{COMPACT_CLOSE}"] * (busy_calls(item, self.max_busy) + 1) + [
            item.answer]

    def reward(self, item: PromptItem, completion_text: str, finished: bool, *, num_tokens: int | None = None,
               max_new_tokens: int | None = None) -> float:
        """A single completion answering without the calculator: 1 for the exact sum followed by EOS."""
        return 1.0 if finished and completion_text == item.answer else 0.0
