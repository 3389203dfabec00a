"""A difficulty curriculum (task.curriculum: pass_rate): prompts the policy always or never solves are sampled less.

The rule. Per training prompt, the actor counts the groups it published and their attempts' successes
(`task.is_success`), from its own rollouts (the `rollouts` topic and, with rl.filter_zero_variance, the
`filtered` one, where the all-equal groups go: exactly the always and never solved ones). A prompt seen in
at least `task.curriculum_min_groups` groups whose attempts all succeeded, or all failed, is *saturated*: it
gets sampling weight `task.curriculum_weight`; every other prompt, seen or not, weight 1. Prompt number k
is one weighted draw over the training items with a generator seeded by (task.seed, k), so it is a pure
function of the seed, k and the counts when it starts.

Exact resume: the counts are the stream's. The actor records a group when it hands it to its writer and,
when it starts again, recounts from its published segments: a group lost in flight or in the writer's
buffer at a death was never published and is counted by neither, a published one by both, once. That needs
every published segment, so the curriculum refuses streams.retention=delete.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipelinerl.streams import FILTERED_TOPIC, ROLLOUT_TOPIC
from pipelinerl.streams.segments import CorruptSegment, list_segments, load_segment, topic_dir
from pipelinerl.tasks.base import PromptItem


@dataclass
class Counts:
    """One prompt's published groups and their attempts' successes."""

    groups: int = 0
    attempts: int = 0
    successes: int = 0

    @property
    def pass_rate(self) -> float:
        return self.successes / self.attempts


class Curriculum:
    """Pass rates of the training prompts and the weighted draw of prompt k (see the module docstring)."""

    def __init__(self, items: Sequence[PromptItem], seed: int, min_groups: int, weight: float,
                 is_success: Callable[[float], bool]):
        self.items, self.seed, self.min_groups, self.weight = list(items), seed, min_groups, weight
        self.is_success = is_success
        self.counts: dict[str, Counts] = {}
        self._cumulative: list[float] | None = None  # cumulative weights over `items`; None: recompute

    def record(self, prompt_id: str, rewards: Sequence[float]) -> None:
        """One published group of `prompt_id` with its attempts' rewards."""
        c = self.counts.setdefault(prompt_id, Counts())
        c.groups += 1
        c.attempts += len(rewards)
        c.successes += sum(map(self.is_success, rewards))
        self._cumulative = None

    def weight_of(self, prompt_id: str) -> float:
        c = self.counts.get(prompt_id)
        saturated = c is not None and c.groups >= self.min_groups and c.successes in (0, c.attempts)
        return self.weight if saturated else 1.0

    def item(self, k: int) -> PromptItem:
        """Prompt number k: one draw weighted by the counts now."""
        if self._cumulative is None:
            self._cumulative = list(itertools.accumulate(self.weight_of(i.id) for i in self.items))
        return random.Random(f"{self.seed}/curriculum/{k}").choices(self.items, cum_weights=self._cumulative)[0]

    def iter_train(self, start: int) -> Iterator[PromptItem]:
        """Prompts start, start + 1, ..., each drawn when the actor asks for it (with the counts then)."""
        for k in itertools.count(start):
            yield self.item(k)

    def saturated_fraction(self) -> float:
        """The share of training prompts sampled at the low weight."""
        return sum(self.weight_of(i.id) != 1.0 for i in self.items) / len(self.items)

    def pass_rates(self) -> list[float]:
        """The pass rate of every prompt seen so far (a histogram's values)."""
        return [c.pass_rate for c in self.counts.values()]

    def recount(self, run_dir: str | Path, writer_id: str) -> None:
        """Count every group `writer_id` published in the rollouts and filtered topics (its earlier lives')."""
        for topic in (ROLLOUT_TOPIC, FILTERED_TOPIC):
            for segment in list_segments(topic_dir(run_dir, topic) / writer_id):
                try:
                    batches, _ = load_segment(segment)
                except (CorruptSegment, FileNotFoundError):  # never trained either (the reader quarantines it)
                    continue
                for batch in batches:
                    prompt_id = json.loads(batch.column("metadata")[0].as_py())["prompt_id"]
                    self.record(prompt_id, batch.column("reward").to_pylist())
