"""The tiny model's long-tailed task: 2-digit sums (short answers) mixed with remainders by repeated
subtraction (long traces), as reasoning traces are mostly short and a few many times longer.

- "37+48=" -> "58" then EOS: the addition task's sum, units-first (tasks/addition.py), 8,100 prompts.
- "23-5=" -> "81-31-8-3" then EOS: n - d, n - 2d, ... down to n mod d, each value units-first (the order
  in which a left-to-right model can borrow) and separated by "-", n in 10..99 and d in 2..9: 720 prompts
  whose traces are about 3 n / d tokens long.

Over the 8,820 prompts (`length_stats`, EOS included) the median answer is 4 tokens, the 92nd percentile
4, the 95th 21, the 99th 66 and the longest 142 (mean 6.1). The reward verifies the whole completion: 1
for the exact answer or trace followed by EOS, else 0. (Rewarding only a trace's last number rewarded
traces with wrong steps that happened to end right, and a task of remainders alone, 720 prompts, was
memorised by the warm start: RL moved neither's held-out success in 100 steps.)
"""

from __future__ import annotations

import numpy as np

from pipelinerl.config import TaskConfig
from pipelinerl.tasks.addition import OPERANDS, answer_text
from pipelinerl.tasks.base import PromptItem, Task, split_held_out

DIVIDENDS = range(10, 100)
DIVISORS = range(2, 10)  # d = 1 would make 99-term traces of nothing but copying
SEPARATOR = "-"


def trace_text(n: int, d: int) -> str:
    """The completion for "n-d=": every value of the repeated subtraction, units-first."""
    values = range(n - d, -1, -d)  # n - d, n - 2d, ... >= 0; the last is n mod d
    return SEPARATOR.join(str(v)[::-1] for v in values)


def arithmetic_items() -> list[PromptItem]:
    """Every sum, then every remainder, in a fixed order (the split shuffles them with the task's seed)."""
    sums = [PromptItem(id=f"{a}+{b}", prompt=f"{a}+{b}=", answer=answer_text(a, b)) for a in OPERANDS for b in OPERANDS]
    remainders = [PromptItem(id=f"{n}-{d}", prompt=f"{n}-{d}=", answer=trace_text(n, d))
                  for n in DIVIDENDS for d in DIVISORS]
    return sums + remainders


class ArithmeticTask(Task):
    name = "arithmetic"
    reports_greedy_success = True  # 8,820 prompts, a tiny model: greedy decoding takes seconds
    exact_completions = True  # the answer is the whole completion text (the warm start trains on it)

    def __init__(self, cfg: TaskConfig):
        train_items, eval_items = split_held_out(arithmetic_items(), cfg.eval_fraction, cfg.seed)
        super().__init__(train_items, eval_items, cfg.seed)

    def reward(self, item: PromptItem, completion_text: str, finished: bool, *, num_tokens: int | None = None,
               max_new_tokens: int | None = None) -> float:
        """1 only for the exact answer or trace followed by EOS; a wrong step, a truncated or padded one scores 0."""
        return 1.0 if finished and completion_text == item.answer else 0.0


def length_stats(items: list[PromptItem]) -> dict[str, float]:
    """Length distribution of the items' answers in tokens, EOS included: what a model that has learned the
    task generates."""
    lengths = np.array([len(item.answer) + 1 for item in items])
    return {"mean": float(lengths.mean()), "median": float(np.median(lengths)),
            **{f"p{q}": float(np.percentile(lengths, q)) for q in (90, 92, 95, 99)}, "max": float(lengths.max())}
