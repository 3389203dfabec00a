"""The remainder task (tasks/remainder.py): traces by hand, the final-answer reward, the long-tailed length
distribution, and a config that fits every trace."""

from pathlib import Path

import pytest

from pipelinerl.config import TaskConfig, load_config
from pipelinerl.tasks import get_task, task_class
from pipelinerl.tasks.remainder import final_answer, length_stats, trace_text
from pipelinerl.tiny_model import ALPHABET

REPO = Path(__file__).resolve().parent.parent


def all_items(task):
    return {i.id: i for i in task.train_items + task.eval_items}


def test_traces_by_hand():
    assert trace_text(23, 5) == "81-31-8-3"  # 18, 13, 8, 3, each units-first
    assert trace_text(10, 5) == "5-0"  # divisible: the trace ends at 0
    assert trace_text(11, 9) == "2"
    assert trace_text(99, 2).split("-")[:3] == ["79", "59", "39"] and trace_text(99, 2).endswith("-1")


def test_every_trace_is_the_repeated_subtraction():
    task = get_task(TaskConfig(name="remainder"))
    items = all_items(task)
    assert len(items) == 90 * 8 and task_class("remainder").exact_completions
    for item_id, item in items.items():
        n, d = map(int, item_id.split("-"))
        values = [int(v[::-1]) for v in item.answer.split("-")]
        assert values == [n - k * d for k in range(1, n // d + 1)], item_id
        assert values[-1] == n % d < d and item.prompt == f"{n}-{d}="
        assert set(item.prompt + item.answer) <= set(ALPHABET)


def test_split_is_deterministic_and_disjoint():
    task, again = (get_task(TaskConfig(name="remainder", eval_fraction=0.2, seed=1)) for _ in range(2))
    train, held = {i.id for i in task.train_items}, {i.id for i in task.eval_items}
    assert len(held) == 144 and len(train) == 576 and not train & held
    assert [i.id for i in again.eval_items] == [i.id for i in task.eval_items]


@pytest.mark.parametrize("text,finished,reward", [
    ("81-31-8-3", True, 1.0),  # the taught trace
    ("3", True, 1.0),  # the final answer alone: the reward checks the answer, not the trace
    ("81-31-9-3", True, 1.0),  # a wrong step but the right last number still counts
    ("81-31-8-3", False, 0.0),  # cut at the length limit: no EOS
    ("81-31-8-2", True, 0.0), ("81-31-8", True, 0.0), ("81-31-8-3-", True, 0.0), ("", True, 0.0),
    ("30", True, 0.0), ("03", True, 0.0),  # 3 with a zero digit: not how the trace writes it
])
def test_reward_checks_the_final_answer_and_eos(text, finished, reward):
    task = get_task(TaskConfig(name="remainder"))
    assert task.reward(all_items(task)["23-5"], text, finished) == reward


def test_final_answer_is_the_text_after_the_last_separator():
    assert final_answer("81-31") == "31" and final_answer("5-0") == "0" and final_answer("7") == "7"
    assert final_answer("") == "" and final_answer("81-") == ""


def test_lengths_are_long_tailed():
    stats = length_stats(list(all_items(get_task(TaskConfig(name="remainder"))).values()))
    assert (stats["median"], stats["max"]) == (26, 142)  # 90 x 8 traces, EOS included
    assert stats["mean"] > stats["median"] and stats["p99"] > 4 * stats["median"] and stats["p10"] <= 7


def test_the_shipped_config_fits_every_trace():
    cfg = load_config(REPO / "configs" / "tiny_remainder.yaml", [])
    task = get_task(cfg.task)
    longest = max(len(i.answer) + 1 for i in all_items(task).values())  # + EOS
    longest_prompt = max(len(i.prompt) + 1 for i in all_items(task).values())  # + BOS
    assert cfg.actor.sampling.max_new_tokens >= longest
    assert cfg.inference.max_model_len >= longest_prompt + cfg.actor.sampling.max_new_tokens
    assert cfg.inference.max_model_len <= cfg.model.tiny.max_position_embeddings
