"""Math word problems scored by math-verify on the answer in the completion's last \\boxed{}.

Grading runs in a worker process: math-verify's own timeouts use signal.alarm, which works only in a
process's main thread, so the worker can enforce them whichever thread of the actor asks; and a hang
that defeats the alarm (C code) is cut by the parent's backstop, which kills and restarts the worker.
"""

from __future__ import annotations

import json
import multiprocessing
import threading
from pathlib import Path

from pipelinerl.config import TaskConfig
from pipelinerl.tasks.base import PromptItem, Task, split_held_out

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
    import math_verify  # noqa: F401  (pay the import before the first timed job)


class MathGrader:
    """A one-process grading pool with a per-sample backstop; thread-safe."""

    def __init__(self, timeout_s: int):
        self.timeout_s = timeout_s
        self._pool = None
        self._lock = threading.Lock()

    def grade(self, gold: str, completion: str) -> str:
        """Outcome of grade_completion, or 'timeout' when the worker did not answer in time."""
        with self._lock:
            if self._pool is None:
                self._pool = multiprocessing.get_context("spawn").Pool(1, initializer=_import_math_verify)
            job = self._pool.apply_async(grade_completion, (gold, completion, self.timeout_s))
        # Two parses and one comparison, each bounded by timeout_s inside the worker, plus room for a
        # fresh worker's start-up on a loaded machine.
        try:
            return job.get(timeout=3 * self.timeout_s + 30)
        except multiprocessing.TimeoutError:
            self.close()
            return "timeout"

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.terminate()
                self._pool.join()
                self._pool = None


def _question_answer(row, where: str) -> tuple[str, str]:
    """A {question|problem, answer} row (any key case), or an Open-Reasoner-Zero [human, assistant] pair."""
    if isinstance(row, list) and len(row) == 2 and isinstance(row[1].get("ground_truth"), dict):
        return str(row[0]["value"]), str(row[1]["ground_truth"]["value"])
    if isinstance(row, dict):
        lower = {str(k).lower(): v for k, v in row.items()}
        question = lower.get("question", lower.get("problem"))
        if question is not None and lower.get("answer") is not None:
            return str(question), str(lower["answer"])
    raise ValueError(f"{where}: expected a {{question, answer}} row (or problem/answer, or an "
                     f"Open-Reasoner-Zero pair), got {str(row)[:200]!r}")


def load_rows(path: str | Path) -> list[tuple[str, str]]:
    """(question, answer) rows from a .jsonl, .json (a list) or .parquet file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"math data file {str(path)!r} does not exist (set task.dataset_path)")
    if path.suffix == ".jsonl":
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        rows = [json.loads(line) for line in lines]
    elif path.suffix == ".json":
        rows = json.loads(path.read_text())
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        raise ValueError(f"{str(path)!r}: use a .jsonl, .json or .parquet file")
    return [_question_answer(row, f"{path.name} row {i}") for i, row in enumerate(rows)]


def _items(path: str) -> list[PromptItem]:
    name = Path(path).name
    return [PromptItem(id=f"{name}:{i}", prompt=question + MATH_INSTRUCTION, answer=answer)
            for i, (question, answer) in enumerate(load_rows(path))]


class MathTask(Task):
    name = "math"

    def __init__(self, cfg: TaskConfig):
        items = _items(cfg.dataset_path)
        if cfg.eval_dataset_path:
            train_items, eval_items = items, _items(cfg.eval_dataset_path)
        else:
            train_items, eval_items = split_held_out(items, cfg.eval_fraction, cfg.seed)
        super().__init__(train_items, eval_items, cfg.seed)
        self.grader = MathGrader(cfg.reward_timeout_s)

    def outcome(self, item: PromptItem, completion_text: str, finished: bool) -> str:
        """'correct' | 'wrong' | 'no_answer' | 'truncated' | 'timeout' (for logging)."""
        if not finished:
            return "truncated"
        return self.grader.grade(item.answer, completion_text)

    def reward(self, item: PromptItem, completion_text: str, finished: bool) -> float:
        """1 for a verified-correct final answer in a finished completion, else 0 (no shaping, seed 000)."""
        return 1.0 if self.outcome(item, completion_text, finished) == "correct" else 0.0

    def close(self) -> None:
        self.grader.close()
