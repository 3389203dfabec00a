"""Instruction prompts without gold answers (seed 004's RLHF data, e.g. a chat data set's prompts): nothing checks
a completion, so only a reward model scores them (reward.kind=model), and there is no held-out success to
evaluate (actor.eval_every_steps 0; the reward model's mean score is the run's measure).

Rows: a .jsonl/.json/.parquet file or `datasets` folder with a prompt text field (task.question_field, else
prompt, instruction or question); task.eval_fraction of them are held out (kept out of training).
"""

from __future__ import annotations

from pathlib import Path

from pipelinerl.config import TaskConfig
from pipelinerl.tasks.base import PromptItem, Task, split_held_out
from pipelinerl.tasks.data import load_prompts


class InstructionsTask(Task):
    name = "instructions"
    has_check = False

    def __init__(self, cfg: TaskConfig):
        name = Path(cfg.dataset_path).name
        items = [PromptItem(id=f"{name}:{i}", prompt=text, answer="")
                 for i, text in enumerate(load_prompts(cfg.dataset_path, cfg.question_field))]
        train_items, eval_items = split_held_out(items, cfg.eval_fraction, cfg.seed)
        super().__init__(train_items, eval_items, cfg.seed)

    def reward(self, item: PromptItem, completion_text: str, finished: bool, *, num_tokens: int | None = None,
               max_new_tokens: int | None = None) -> float:
        raise RuntimeError("the instructions task has no check: its rewards come from a reward model "
                           "(reward.kind=model)")
