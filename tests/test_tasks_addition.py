"""The addition task: split, answers, reward, resumable training order."""

import itertools

import pytest

from pipelinerl.config import ConfigError, TaskConfig
from pipelinerl.tasks import get_task, task_class
from pipelinerl.tiny.model import ALPHABET


def test_split_is_deterministic_disjoint_and_complete():
    task = get_task(TaskConfig(name="addition", seed=3, eval_fraction=0.06))
    again = get_task(TaskConfig(name="addition", seed=3, eval_fraction=0.06))
    other = get_task(TaskConfig(name="addition", seed=4, eval_fraction=0.06))
    train, held = {i.id for i in task.train_items}, {i.id for i in task.eval_items}
    assert len(held) == round(0.06 * 8100) == 486 and len(train) == 8100 - 486 and not train & held
    assert [i.id for i in again.eval_items] == [i.id for i in task.eval_items]
    assert {i.id for i in other.eval_items} != held


def test_prompts_and_answers_use_the_tokenizer_alphabet_units_first():
    task = get_task(TaskConfig())
    items = {i.id: i for i in task.train_items + task.eval_items}
    assert (items["37+48"].prompt, items["37+48"].answer) == ("37+48=", "58")  # 85, units first
    assert items["99+99"].answer == "891" and items["10+10"].answer == "02"
    assert all(set(i.prompt + i.answer) <= set(ALPHABET) for i in items.values())
    assert items["37+48"].messages == [{"role": "user", "content": "37+48="}]


@pytest.mark.parametrize("text,finished,reward", [
    ("58", True, 1.0),  # exact answer, then EOS
    ("58", False, 0.0),  # right digits but cut at the length limit: no EOS
    ("85", True, 0.0),  # the usual digit order is not the task's answer
    ("580", True, 0.0), ("5", True, 0.0), ("", True, 0.0), ("58+", True, 0.0),
])
def test_reward_only_for_exact_answer_then_eos(text, finished, reward):
    task = get_task(TaskConfig())
    item = next(i for i in task.train_items + task.eval_items if i.id == "37+48")
    assert task.reward(item, text, finished) == reward


def test_task_class_gives_capabilities_without_building_the_task():
    task = get_task(TaskConfig())
    assert task_class("addition") is type(task) and task_class("addition").reports_greedy_success
    assert not task_class("math").reports_greedy_success  # its class only: no data set, no worker
    assert task.is_success(1.0) and not task.is_success(0.99)
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        task_class("nope")


def test_training_order_covers_each_epoch_once_and_resumes():
    task = get_task(TaskConfig(seed=1))
    n = len(task.train_items)
    first_two_epochs = [i.id for i in itertools.islice(task.iter_train(), 2 * n)]
    assert sorted(first_two_epochs[:n]) == sorted(i.id for i in task.train_items)
    assert first_two_epochs[:n] != first_two_epochs[n:]  # reshuffled per epoch
    resumed = [i.id for i in itertools.islice(task.iter_train(start=n - 5), 10)]
    assert resumed == first_two_epochs[n - 5:n + 5]
    assert not set(first_two_epochs) & {i.id for i in task.eval_items}


def test_task_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="task.reward_timeout_s"):
        TaskConfig(reward_timeout_s=0)
    with pytest.raises(ConfigError, match="task.dataset_path"):
        TaskConfig(name="math")
