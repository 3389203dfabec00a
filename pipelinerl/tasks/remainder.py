"""Remainder by repeated subtraction, the tiny model's long-tailed task: "23-5=" -> "81-31-8-3" then EOS.

The completion is a trace, like a reasoning trace: n - d, n - 2d, ... down to the first value below d,
each written units-first (the order in which a left-to-right model can borrow, as in the addition task)
and separated by "-". Its length is about 3 n / d tokens, so over n in 10..99 and d in 2..9 most traces
are short and a few many times longer (`length_stats`: median 26 tokens, p99 132, max 142). The reward is
verifiable and checks the final answer only: 1 when the completion ended (EOS) and its last number is
n mod d, whatever trace led there.
"""

from __future__ import annotations

import numpy as np

from pipelinerl.config import TaskConfig
from pipelinerl.tasks.base import PromptItem, Task, split_held_out

DIVIDENDS = range(10, 100)
DIVISORS = range(2, 10)  # 90 x 8 = 720 prompts; d = 1 would make 99-term traces of nothing but copying
SEPARATOR = "-"


def trace_text(n: int, d: int) -> str:
    """The completion the warm start teaches for n - d: every value of the repeated subtraction, units-first."""
    values = range(n - d, -1, -d)  # n - d, n - 2d, ... >= 0; the last is n mod d
    return SEPARATOR.join(str(v)[::-1] for v in values)


def final_answer(completion_text: str) -> str:
    """The completion's last number as written (units-first): the text after its last separator."""
    return completion_text.rsplit(SEPARATOR, 1)[-1]


class RemainderTask(Task):
    name = "remainder"
    reports_greedy_success = True  # 720 prompts, a tiny model: greedy decoding takes seconds
    exact_completions = True  # the answer is the whole completion text (the warm start trains on it)

    def __init__(self, cfg: TaskConfig):
        items = [PromptItem(id=f"{n}-{d}", prompt=f"{n}-{d}=", answer=trace_text(n, d))
                 for n in DIVIDENDS for d in DIVISORS]
        train_items, eval_items = split_held_out(items, cfg.eval_fraction, cfg.seed)
        super().__init__(train_items, eval_items, cfg.seed)

    def reward(self, item: PromptItem, completion_text: str, finished: bool, *, num_tokens: int | None = None,
               max_new_tokens: int | None = None) -> float:
        """1 when the model ended its completion and its last number is n mod d, written as the trace writes
        it (no leading or trailing zeros); else 0."""
        n, d = map(int, item.id.split("-"))
        return 1.0 if finished and final_answer(completion_text) == str(n % d)[::-1] else 0.0


def length_stats(items: list[PromptItem]) -> dict[str, float]:
    """Length distribution of the traces the items' answers are (in tokens, EOS included): what a model that
    has learned the task generates."""
    lengths = np.array([len(item.answer) + 1 for item in items])
    return {"mean": float(lengths.mean()), "p10": float(np.percentile(lengths, 10)),
            "median": float(np.median(lengths)), "p90": float(np.percentile(lengths, 90)),
            "p99": float(np.percentile(lengths, 99)), "max": float(lengths.max())}
