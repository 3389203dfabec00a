"""Eval sets, sampled and graded: the task's held-out split (`default`) and the named sets of task.eval_sets.

The actor runs `actor_suites` every actor.eval_every_steps (scheduler.py); `pipelinerl eval --sets` runs the
suites it names (eval/command.py). Both build their suites here and sample them with `sample_suite`, so a set
means the same in both: its items (a file's first max_prompts rows), completions per item and temperature.
A named set's file is read when its suite is built, at the start of the actor or of `pipelinerl eval`, so
a missing file stops the start, naming the set's path key; loading a config never reads it (`pipelinerl
plan` and the config tests load the 7B configs without their data).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import httpx

from pipelinerl.actor.client import Completion, CompletionsClient
from pipelinerl.actor.episodes import episode_outcome, sample_episodes
from pipelinerl.config import Config
from pipelinerl.config.actor import DEFAULT_EVAL_SET
from pipelinerl.envs.episode import NO_VERSION
from pipelinerl.envs.runner import EpisodeResult
from pipelinerl.eval.metrics import ItemOutcome
from pipelinerl.tasks import PromptItem, Task


@dataclass(frozen=True)
class EvalSuite:
    """One eval set sampled one way."""

    name: str  # the set: `default` or a key of task.eval_sets
    items: list[PromptItem]
    samples: int  # completions per item
    temperature: float  # 0: greedy

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def mode(self) -> str:
        """How it is sampled, as the `pipelinerl eval` report names it."""
        return "greedy" if self.greedy else "sampled"


@dataclass
class SampledItem:
    """One item of a suite: its prompt tokens, its completions (a multi-turn task: episodes) and their
    grades."""

    item: PromptItem
    prompt_ids: list[int]
    completions: list[Completion]
    outcome: ItemOutcome
    episodes: list[EpisodeResult] = field(default_factory=list)


def token_versions(s: SampledItem) -> set[int]:
    """The policy versions that generated the item's model tokens."""
    return ({v for c in s.completions for v in c.versions}
            | {v for e in s.episodes for v in e.episode.versions if v != NO_VERSION})


def held_out_suite(cfg: Config, task: Task, samples: int, temperature: float) -> EvalSuite:
    """The `default` set: the first actor.eval_samples items of the task's held-out split."""
    return EvalSuite(DEFAULT_EVAL_SET, task.eval_items[: cfg.actor.eval_samples], samples, temperature)


def named_suite(cfg: Config, task: Task, name: str) -> EvalSuite:
    """task.eval_sets[name] with its file read now: a missing or malformed file is a ValueError naming it."""
    s, t = cfg.task.eval_sets[name], cfg.task
    key = f"task.eval_sets.{name}.path"
    items = task.file_items(s.path, s.question_field or t.question_field, s.answer_field or t.answer_field, key)
    if not items:
        raise ValueError(f"eval set {name!r}: {s.path!r} has no rows (set {key})")
    return EvalSuite(name, items[: s.max_prompts], s.samples, s.temperature)


def actor_suites(cfg: Config, task: Task) -> list[EvalSuite]:
    """What the actor evaluates: `default` when actor.eval_samples > 0 (one completion per item, greedy
    unless actor.eval_greedy is false), then every named set."""
    a = cfg.actor
    temperature = 0.0 if a.eval_greedy else a.sampling.temperature
    default = [held_out_suite(cfg, task, 1, temperature)] if a.eval_samples else []
    return default + [named_suite(cfg, task, name) for name in cfg.task.eval_sets]


def grade(task: Task, item: PromptItem, completions: list[Completion], max_new_tokens: int) -> ItemOutcome:
    """An ItemOutcome: each completion's task.reward and task.is_success."""
    rewards = [task.reward(item, c.text, c.finished, num_tokens=len(c.token_ids), max_new_tokens=max_new_tokens)
               for c in completions]
    return ItemOutcome(item.id, [c.text for c in completions], rewards, [task.is_success(r) for r in rewards],
                       [len(c.token_ids) for c in completions], [c.finished for c in completions])


async def sample_suite(client: CompletionsClient, http: httpx.AsyncClient, task: Task, tokenizer,
                       suite: EvalSuite, cfg: Config, gate: asyncio.Semaphore | None = None) -> list[SampledItem]:
    """Every item of the suite, in order: its `samples` completions in one request (at most `gate`'s count of
    items at once; None: no bound), graded off the event loop (the math task's grading may block). A
    multi-turn task's item is `samples` episodes with its environment (actor.episode's limits), graded by it.
    Every request runs at actor.eval_priority (behind queued training requests)."""
    async def one(item: PromptItem) -> SampledItem:
        ids = item.token_ids(tokenizer)
        async with gate or contextlib.nullcontext():
            if task.multi_turn:
                episodes = await sample_episodes(client, http, task, tokenizer, item, cfg, suite.samples,
                                                 suite.greedy, suite.temperature, name=f"eval {suite.name}/{item.id}",
                                                 priority=cfg.actor.eval_priority)
                return SampledItem(item, ids, [], episode_outcome(task, item, episodes), episodes)
            completions = await client.complete(http, ids, suite.greedy, suite.samples, suite.temperature,
                                                priority=cfg.actor.eval_priority)
        outcome = await asyncio.to_thread(grade, task, item, completions, cfg.actor.sampling.max_new_tokens)
        return SampledItem(item, ids, completions, outcome)

    return list(await asyncio.gather(*map(one, suite.items)))
