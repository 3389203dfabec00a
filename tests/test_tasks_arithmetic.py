"""The arithmetic task (tasks/arithmetic.py): sums and remainder traces by hand, the exact-answer reward,
the long-tailed length distribution, and a config that fits every trace."""

from pathlib import Path

import pytest

from pipelinerl.config import TaskConfig, load_config
from pipelinerl.tasks import get_task, task_class
from pipelinerl.tasks.arithmetic import length_stats, trace_text
from pipelinerl.tiny.model import ALPHABET

REPO = Path(__file__).resolve().parent.parent


def all_items(task):
    return {i.id: i for i in task.train_items + task.eval_items}


def test_traces_by_hand():
    assert trace_text(23, 5) == "81-31-8-3"  # 18, 13, 8, 3, each units-first
    assert trace_text(10, 5) == "5-0"  # divisible: the trace ends at 0
    assert trace_text(11, 9) == "2"
    assert trace_text(99, 2).split("-")[:3] == ["79", "59", "39"] and trace_text(99, 2).endswith("-1")


def test_items_are_every_sum_and_every_remainder_trace():
    task = get_task(TaskConfig(name="arithmetic"))
    items = all_items(task)
    assert len(items) == 90 * 90 + 90 * 8 and task_class("arithmetic").exact_completions
    assert (items["37+48"].prompt, items["37+48"].answer) == ("37+48=", "58")  # 85 units-first, as addition
    remainders = {k: v for k, v in items.items() if "-" in k}
    assert len(remainders) == 720
    for item_id, item in remainders.items():
        n, d = map(int, item_id.split("-"))
        values = [int(v[::-1]) for v in item.answer.split("-")]
        assert values == [n - k * d for k in range(1, n // d + 1)], item_id
        assert values[-1] == n % d < d and item.prompt == f"{n}-{d}="
    assert all(set(i.prompt + i.answer) <= set(ALPHABET) for i in items.values())


def test_split_is_deterministic_disjoint_and_holds_out_both_kinds():
    task, again = (get_task(TaskConfig(name="arithmetic", seed=1)) for _ in range(2))
    train, held = {i.id for i in task.train_items}, {i.id for i in task.eval_items}
    assert len(held) == round(0.06 * 8820) == 529 and len(train) == 8820 - 529 and not train & held
    assert [i.id for i in again.eval_items] == [i.id for i in task.eval_items]
    assert 20 <= sum("-" in i for i in held) <= 70  # about 6 % of the 720 remainders


@pytest.mark.parametrize("item_id,text,finished,reward", [
    ("23-5", "81-31-8-3", True, 1.0),  # the trace
    ("23-5", "3", True, 0.0),  # the final answer alone: the reward checks the whole trace
    ("23-5", "81-31-9-3", True, 0.0),  # a wrong step that happens to end right
    ("23-5", "81-31-8-3", False, 0.0),  # cut at the length limit: no EOS
    ("23-5", "81-31-8-2", True, 0.0), ("23-5", "81-31-8", True, 0.0), ("23-5", "81-31-8-3-", True, 0.0),
    ("23-5", "18-13-8-3", True, 0.0),  # the usual digit order is not the task's trace
    ("37+48", "58", True, 1.0), ("37+48", "85", True, 0.0), ("37+48", "58", False, 0.0), ("37+48", "", True, 0.0),
])
def test_reward_is_for_the_exact_answer_then_eos(item_id, text, finished, reward):
    task = get_task(TaskConfig(name="arithmetic"))
    assert task.reward(all_items(task)[item_id], text, finished) == reward


def test_lengths_are_long_tailed():
    stats = length_stats(list(all_items(get_task(TaskConfig(name="arithmetic"))).values()))
    assert (stats["median"], stats["p92"], stats["max"]) == (4, 4, 142)  # EOS included
    assert stats["p99"] > 10 * stats["median"] and stats["mean"] > stats["median"]


def test_the_shipped_config_fits_every_trace():
    cfg = load_config(REPO / "configs" / "tiny_long_tail.yaml", [])
    items = all_items(get_task(cfg.task)).values()
    longest = max(len(i.answer) + 1 for i in items)  # + EOS
    longest_prompt = max(len(i.prompt) + 1 for i in items)  # + BOS
    assert cfg.actor.sampling.max_new_tokens >= longest
    assert cfg.inference.max_model_len >= longest_prompt + cfg.actor.sampling.max_new_tokens
    assert cfg.inference.max_model_len <= cfg.model.tiny.max_position_embeddings
    assert cfg.actor.eval_samples >= len(get_task(cfg.task).eval_items)  # the whole held-out split
