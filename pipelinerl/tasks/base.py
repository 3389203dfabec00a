"""What every task gives the actor: training prompts, held-out prompts and a reward."""

from __future__ import annotations

import abc
import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pipelinerl.envs.episode import EpisodeLimits
from pipelinerl.tasks.data import load_rows


@dataclass(frozen=True)
class PromptItem:
    """One prompt of a task's data set."""

    id: str  # stable id (logged, written to the rollout stream)
    prompt: str  # the user message text
    answer: str  # the gold answer: the exact completion text (addition, arithmetic), the gold expression (math)

    @property
    def messages(self) -> list[dict]:
        """The prompt as chat messages (single user turn), for /v1/chat/completions."""
        return [{"role": "user", "content": self.prompt}]

    def token_ids(self, tokenizer) -> list[int]:
        """The chat-templated prompt tokens, with the generation prompt: what the servers complete."""
        encoded = tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=True)
        return list(encoded["input_ids"])


class Task(abc.ABC):
    """A data set split into train and held-out items, and a reward. Subclasses fill both lists."""

    name: str = ""
    # Held-out greedy success with transformers is cheap enough for the launcher to report it before and
    # after RL (`pipelinerl run` prints both at the end); False for tasks whose model or data set is large.
    reports_greedy_success: bool = False
    # The gold answer is the exact completion text, so a supervised warm start can train on it (tiny tasks).
    exact_completions: bool = False
    # Samples are multi-turn episodes: `environment(item)` answers each model turn (pipelinerl/envs/), and the
    # episode's reward is the environment's, not `reward()`'s.
    multi_turn: bool = False
    # `reward()` checks a completion (an exact answer, math-verify). False: nothing can (instruction prompts), and
    # only a reward model scores them (reward.kind=model).
    has_check: bool = True
    # A multi-turn task's limits for the episodes it runs itself: its warm start's demonstrations and the
    # held-out greedy report (the actor's episodes take actor.episode's).
    episode_limits: EpisodeLimits = EpisodeLimits()
    run_dir: str | None = None  # the run directory (get_task's), where a task finds servers the launcher started
    #   for it (task.openenv.serve); None outside a run

    def __init__(self, train_items: list[PromptItem], eval_items: list[PromptItem], seed: int):
        if not train_items or not eval_items:
            raise ValueError(f"task {self.name!r}: the train or eval split is empty; check task.eval_fraction")
        if {i.id for i in train_items} & {i.id for i in eval_items}:
            raise ValueError(f"task {self.name!r}: held-out items are also training items "
                             "(is task.eval_dataset_path the training file?)")
        self.train_items, self.eval_items, self.seed = train_items, eval_items, seed

    def use_servers(self, client, http) -> None:  # noqa: B027 - a hook: only tasks that reach servers override it
        """The actor's completions client and HTTP client, given at its start, for a task whose environments
        reach the run's servers themselves (a verifiers environment's judges: the judge servers)."""

    def iter_train(self, start: int = 0) -> Iterator[PromptItem]:
        """Training items forever, reshuffled each epoch; item number k is a pure function of (seed, k),
        so an actor resumes exactly by passing the count it had consumed."""
        n = len(self.train_items)
        position = start
        while True:
            epoch, offset = divmod(position, n)
            order = list(range(n))
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
            for index in order[offset:]:
                yield self.train_items[index]
            position = (epoch + 1) * n

    def prompt_text(self, question: str) -> str:
        """The user message of a question read from a data file; as is by default."""
        return question

    def file_items(self, path: str, question_field: str | None = None, answer_field: str | None = None,
                   setting: str = "task.dataset_path") -> list[PromptItem]:
        """The (question, answer) rows of a data file (tasks/data.py) as this task's items, ids `<file>:<row>`;
        `setting` names the config key of the path in the error for a missing file."""
        name = Path(path).name
        return [PromptItem(id=f"{name}:{i}", prompt=self.prompt_text(question), answer=answer)
                for i, (question, answer) in enumerate(load_rows(path, question_field, answer_field, setting))]

    @abc.abstractmethod
    def reward(self, item: PromptItem, completion_text: str, finished: bool, *, num_tokens: int | None = None,
               max_new_tokens: int | None = None) -> float:
        """Reward of one completion. completion_text excludes the EOS token; finished is True when the
        model ended it (EOS), False when it was cut at the length limit; num_tokens of max_new_tokens is
        its length, for tasks whose reward depends on it (the math task's overlong penalty)."""

    def environment(self, item: PromptItem):
        """A fresh pipelinerl.envs.Environment for one episode of `item` (multi-turn tasks only)."""
        raise NotImplementedError(f"task {self.name!r} is single-turn: it has no environment")

    def demonstration(self, item: PromptItem) -> list[str]:
        """The model turns' texts of an episode that solves `item` (a multi-turn task's warm start)."""
        raise NotImplementedError(f"task {self.name!r} has no demonstrations")

    def outcome_counts(self, reset: bool = False) -> dict[str, int]:
        """Completions per grading outcome since the last reset (the actor logs them); none by default."""
        return {}

    def is_success(self, reward: float) -> bool:
        """Whether a completion with this reward solved its prompt: what the actor's `actor/success` and
        `eval/success` count. Every shipped task gives 1.0 for a solved prompt and less otherwise."""
        return reward >= 1.0

    def close(self) -> None:  # noqa: B027 - a hook: only tasks holding workers override it
        """Release what the task holds (worker processes); the task stays usable and reopens them."""


def add_import_path(folder: str, setting: str) -> None:
    """Make the modules of `folder` (the config's `setting`) importable here and in the processes this one starts
    (PYTHONPATH): a task's environment or agent module that is not installed."""
    path = str(Path(folder).resolve())
    if not Path(path).is_dir():
        raise FileNotFoundError(f"{setting}: {path} is not a folder")
    if path not in sys.path:
        sys.path.insert(0, path)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if path not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([path, *parts])


def split_held_out(items: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """Deterministic (train, eval) split: a seeded shuffle, the first round(fraction * n) held out."""
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    num_eval = max(1, round(eval_fraction * len(items)))
    eval_items = [items[i] for i in order[:num_eval]]
    train_items = [items[i] for i in sorted(order[num_eval:])]
    return train_items, eval_items
