"""Math word problems scored by math-verify on the answer in the completion's last \\boxed{}.

Grading runs in worker processes (pipelinerl/tasks/grading.py): math-verify's own timeouts use
signal.alarm, which works only in a process's main thread, so a worker can enforce them whichever
thread of the actor asks; and a hang that defeats the alarm (C code) is cut by the pool's per-job
timeout, which kills and replaces that one worker. Data files are read by pipelinerl/tasks/data.py.
"""

from __future__ import annotations

import threading
from collections import Counter

from pipelinerl.config import TaskConfig
from pipelinerl.tasks.base import PromptItem, Task, split_held_out
from pipelinerl.tasks.grading import GradingPool

OUTCOMES = ("correct", "wrong", "no_answer", "truncated", "timeout")

# Appended to every question: the reward reads only the last \boxed{} of the completion.
MATH_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (nested braces balanced), or None if there is none or it is open."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for pos in range(begin - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[pos], 0)
        if depth == 0:
            return text[begin:pos]
    return None


def grade_completion(gold: str, completion: str, timeout_s: int) -> str:
    """'correct' | 'wrong' | 'no_answer'. Runs in the grading worker (its main thread)."""
    from math_verify import parse, verify

    content = last_boxed(completion)
    if content is None or not content.strip():
        return "no_answer"
    predicted = parse(f"\\boxed{{{content}}}", parsing_timeout=timeout_s)
    gold_content = last_boxed(gold) or gold.strip().strip("$")
    expected = parse(f"\\boxed{{{gold_content}}}", parsing_timeout=timeout_s)
    if not predicted:
        return "no_answer"
    return "correct" if verify(expected, predicted, timeout_seconds=timeout_s) else "wrong"


def _import_math_verify() -> None:
    import math_verify  # noqa: F401  (pay the import before the worker says it is ready)


def job_timeout_s(reward_timeout_s: int) -> float:
    """The pool's backstop per completion: two parses and one comparison, each bounded by
    reward_timeout_s inside the worker, plus a second for the pipe."""
    return 3 * reward_timeout_s + 1.0


def overlong_penalty(num_tokens: int, max_new_tokens: int, buffer_tokens: int, penalty: float) -> float:
    """What a completion of num_tokens loses for reaching into the last buffer_tokens before the limit:
    0 before that zone, rising linearly to `penalty` at max_new_tokens."""
    if buffer_tokens <= 0:
        return 0.0
    if buffer_tokens > max_new_tokens:
        raise ValueError(f"task.overlong_buffer_tokens={buffer_tokens} exceeds actor.sampling.max_new_tokens="
                         f"{max_new_tokens}; make the buffer a part of the limit")
    into_zone = num_tokens - (max_new_tokens - buffer_tokens)
    return penalty * min(max(into_zone, 0), buffer_tokens) / buffer_tokens


class MathTask(Task):
    name = "math"

    def __init__(self, cfg: TaskConfig):
        items = self.file_items(cfg.dataset_path, cfg.question_field, cfg.answer_field)
        if cfg.eval_dataset_path:
            train_items, eval_items = items, self.file_items(cfg.eval_dataset_path, cfg.question_field,
                                                             cfg.answer_field, "task.eval_dataset_path")
        else:
            train_items, eval_items = split_held_out(items, cfg.eval_fraction, cfg.seed)
        super().__init__(train_items, eval_items, cfg.seed)
        self.cfg = cfg
        self.grader = GradingPool(cfg.reward_workers, job_timeout_s(cfg.reward_timeout_s), grade_completion,
                                  initializer=_import_math_verify)
        self._counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()

    def prompt_text(self, question: str) -> str:
        return question + MATH_INSTRUCTION

    def outcome(self, item: PromptItem, completion_text: str, finished: bool) -> str:
        """'correct' | 'wrong' | 'no_answer' | 'truncated' | 'timeout', counted for outcome_counts().
        A truncated completion is graded only under task.credit_truncated, and is then 'correct' when its
        answer is; otherwise it stays 'truncated'."""
        if finished or self.cfg.credit_truncated:
            result = self.grader.grade(item.answer, completion_text, self.cfg.reward_timeout_s)
            if not finished and result != "correct":
                result = "truncated"
        else:
            result = "truncated"
        with self._counts_lock:
            self._counts[result] += 1
        return result

    def reward(self, item: PromptItem, completion_text: str, finished: bool, *, num_tokens: int | None = None,
               max_new_tokens: int | None = None) -> float:
        """1 for a verified-correct final answer (in a finished completion, or a truncated one under
        task.credit_truncated), else 0; minus the overlong penalty when task.overlong_buffer_tokens > 0,
        which needs the completion's length and the limit, both in tokens."""
        reward = 1.0 if self.outcome(item, completion_text, finished) == "correct" else 0.0
        if self.cfg.overlong_buffer_tokens > 0:
            if num_tokens is None or max_new_tokens is None:
                raise ValueError("task.overlong_buffer_tokens is set but the caller gave no num_tokens / "
                                 "max_new_tokens: this actor cannot apply the overlong penalty; set it to 0")
            reward -= overlong_penalty(num_tokens, max_new_tokens, self.cfg.overlong_buffer_tokens,
                                       self.cfg.overlong_penalty)
        return reward

    def is_success(self, reward: float) -> bool:
        """Correct answers score above 0 even after the largest overlong penalty (task.overlong_penalty < 1),
        wrong ones at most 0."""
        return reward > 0.0

    def outcome_counts(self, reset: bool = False) -> dict[str, int]:
        """How many completions ended in each outcome since the last reset (all five keys, for logging)."""
        with self._counts_lock:
            counts = {name: self._counts[name] for name in OUTCOMES}
            if reset:
                self._counts.clear()
        return counts

    def close(self) -> None:
        self.grader.close()
