"""2-digit addition for the tiny model: "37+48=" -> "58" then EOS (the sum 85 written units-first).

Units-first is the order in which a left-to-right model can compute the digits (each carry is known
when its digit is written): on the tiny model, RL reached 0.89-0.94 held-out greedy this way against
0.74-0.78 in the usual order. Prompts and answers use only the tiny tokenizer's alphabet.
"""

from __future__ import annotations

from pipelinerl.config import TaskConfig
from pipelinerl.tasks.base import PromptItem, Task, split_held_out

OPERANDS = range(10, 100)  # 90 x 90 = 8,100 ordered pairs


def answer_text(a: int, b: int) -> str:
    """The completion the reward accepts for a + b: the sum's digits, units first."""
    return str(a + b)[::-1]


class AdditionTask(Task):
    name = "addition"
    reports_greedy_success = True  # a 90 x 90 table and a tiny model: greedy decoding takes seconds
    exact_completions = True  # the answer is the whole completion text (the warm start trains on it)

    def __init__(self, cfg: TaskConfig):
        items = [PromptItem(id=f"{a}+{b}", prompt=f"{a}+{b}=", answer=answer_text(a, b))
                 for a in OPERANDS for b in OPERANDS]
        train_items, eval_items = split_held_out(items, cfg.eval_fraction, cfg.seed)
        super().__init__(train_items, eval_items, cfg.seed)

    def reward(self, item: PromptItem, completion_text: str, finished: bool, *, num_tokens: int | None = None,
               max_new_tokens: int | None = None) -> float:
        """1 only for the exact answer followed by EOS; a truncated or padded answer scores 0."""
        return 1.0 if finished and completion_text == item.answer else 0.0
