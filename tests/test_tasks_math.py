"""The math task: loaders for the usual formats and math-verify rewards on real-looking answers."""

import json
from pathlib import Path

import pytest

from pipelinerl.config import TaskConfig
from pipelinerl.tasks import get_task
from pipelinerl.tasks.data import load_rows
from pipelinerl.tasks.math_task import MATH_INSTRUCTION, last_boxed

ROWS = [
    {"question": "What is 1 divided by 2?", "answer": "\\frac{1}{2}"},
    {"question": "Solve 0 < x <= 1 as an interval.", "answer": "(0,1]"},
    {"question": "Simplify sqrt(8)/2.", "answer": "\\sqrt{2}"},
    {"question": "How many primes are below 10?", "answer": "4"},
    {"question": "Expand (x+1)^2 - 2x.", "answer": "x^2+1"},
]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    path = tmp_path_factory.mktemp("math") / "train.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in ROWS) + "\n")
    task = get_task(TaskConfig(name="math", dataset_path=str(path), eval_fraction=0.2, reward_timeout_s=1))
    yield task
    task.close()


def item_with(task, answer):
    return next(i for i in task.train_items + task.eval_items if i.answer == answer)


@pytest.mark.parametrize("gold,completion,outcome", [
    ("\\frac{1}{2}", "Half of one is 0.5, so \\boxed{0.5}", "correct"),
    ("\\frac{1}{2}", "So the answer is \\boxed{1/2}.", "correct"),
    ("\\frac{1}{2}", "First \\boxed{3}, but wait, it is \\boxed{\\frac{1}{2}}", "correct"),  # the last box counts
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{2}} no, actually \\boxed{2}", "wrong"),
    ("(0,1]", "The set is \\boxed{(0, 1]}", "correct"),
    ("(0,1]", "The set is \\boxed{[0,1]}", "wrong"),
    ("\\sqrt{2}", "We get $\\boxed{\\sqrt 2}$", "correct"),
    ("4", "There are four primes: 2, 3, 5, 7. The answer is 4.", "no_answer"),
    ("4", "\\boxed{}", "no_answer"),
    ("4", "\\boxed{4", "no_answer"),  # unclosed box
    ("x^2+1", "\\boxed{1 + x^{2}}", "correct"),
    ("4", "\\boxed{#@!}}}{{", "wrong"),  # garbage in the box
])
def test_math_outcomes(task, gold, completion, outcome):
    item = item_with(task, gold)
    assert task.outcome(item, completion, finished=True) == outcome
    assert task.reward(item, completion, finished=True) == (1.0 if outcome == "correct" else 0.0)


def test_truncated_completion_scores_zero_and_prompt_asks_for_a_box(task):
    item = item_with(task, "4")
    assert task.outcome(item, "\\boxed{4}", finished=False) == "truncated"
    assert task.reward(item, "\\boxed{4}", finished=False) == 0.0
    assert item.prompt.endswith(MATH_INSTRUCTION) and len(task.eval_items) == 1 and len(task.train_items) == 4


def test_pathological_answer_is_cut_by_the_timeout(task):
    import time

    nested = "\\boxed{" + "(" * 300 + "1" + ")" * 300 + "}"
    started = time.monotonic()
    assert task.reward(item_with(task, "4"), nested, finished=True) == 0.0
    assert time.monotonic() - started < 3 * 1 + 5  # three math-verify calls of at most 1 s, plus IPC


def test_loaders_accept_json_parquet_and_open_reasoner_zero_pairs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    orz = [[{"from": "human", "value": "1+1?"}, {"from": "assistant", "ground_truth": {"value": "2"}}]]
    (tmp_path / "orz.json").write_text(json.dumps(orz))
    pq.write_table(pa.Table.from_pylist([{"Problem": "AIME?", "Answer": 204}]), tmp_path / "aime.parquet")
    assert load_rows(tmp_path / "orz.json") == [("1+1?", "2")]
    assert load_rows(tmp_path / "aime.parquet") == [("AIME?", "204")]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "no question"}))
    with pytest.raises(ValueError, match="bad.jsonl row 0"):
        load_rows(tmp_path / "bad.jsonl")


def test_separate_eval_file(tmp_path):
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in ROWS))
    test.write_text(json.dumps({"problem": "2+2?", "answer": "4"}))
    task = get_task(TaskConfig(name="math", dataset_path=str(train), eval_dataset_path=str(test)))
    assert len(task.train_items) == 5 and [i.answer for i in task.eval_items] == ["4"]
    with pytest.raises(ValueError, match="also training items"):
        get_task(TaskConfig(name="math", dataset_path=str(train), eval_dataset_path=str(train)))


def test_last_boxed_balances_braces():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{1} \\boxed{{2}}") == "{2}" and last_boxed("none") is None


def test_outcome_counts_include_truncated_and_reset(task):
    task.outcome_counts(reset=True)
    item = item_with(task, "4")
    for text, finished in [("\\boxed{4}", True), ("\\boxed{5}", True), ("4", True), ("\\boxed{4}", False)]:
        task.reward(item, text, finished)
    assert task.outcome_counts(reset=True) == {"correct": 1, "wrong": 1, "no_answer": 1, "truncated": 1,
                                               "timeout": 0}
    assert sum(task.outcome_counts().values()) == 0


def test_credit_truncated_and_overlong_penalty_by_hand(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in ROWS))
    cfg = TaskConfig(name="math", dataset_path=str(path), credit_truncated=True, overlong_buffer_tokens=20,
                     overlong_penalty=0.5)
    options = get_task(cfg)
    try:
        item = item_with(options, "4")

        def reward(text, finished, n):
            return options.reward(item, text, finished, num_tokens=n, max_new_tokens=100)

        # The zone is tokens 80..100; the penalty is 0.5 x (tokens past 80) / 20.
        assert reward("\\boxed{4}", True, 70) == 1.0  # before the zone
        assert reward("\\boxed{4}", True, 90) == 1.0 - 0.5 * 10 / 20  # 0.75
        assert reward("\\boxed{5}", True, 95) == 0.0 - 0.5 * 15 / 20  # -0.375
        assert reward("\\boxed{4}", False, 100) == 1.0 - 0.5  # truncated but correct: credited, full penalty
        assert reward("\\boxed{5}", False, 100) == -0.5
        assert options.outcome(item, "\\boxed{4}", finished=False) == "correct"
        assert options.outcome(item, "\\boxed{5}", finished=False) == "truncated"
        assert options.is_success(0.5) and not options.is_success(0.0) and not options.is_success(-0.375)
        with pytest.raises(ValueError, match="num_tokens"):
            options.reward(item, "\\boxed{4}", True)  # an actor that does not pass the length
    finally:
        options.close()


def test_reward_options_are_checked():
    with pytest.raises(ValueError, match="overlong_penalty"):
        TaskConfig(overlong_penalty=1.0)
    with pytest.raises(ValueError, match="reward_workers"):
        TaskConfig(reward_workers=0)


def test_named_eval_sets_of_the_math_task(tmp_path, task):
    """tests/data/math_eval.jsonl's {Problem, Answer} rows read with the default field names, worded like
    training prompts and graded by math-verify; a set with its own field names; max_prompts."""
    from pipelinerl.config import load_config
    from pipelinerl.eval.sets import named_suite

    data = Path(__file__).parent / "data"
    (tmp_path / "own.jsonl").write_text(json.dumps({"prompt": "What is 2+2?", "solution": "4"}) + "\n")
    cfg = load_config(Path(__file__).parent.parent / "configs" / "tiny_cpu.yaml", [
        f"run_dir={tmp_path}", "task.name=math", f"task.dataset_path={tmp_path / 'own.jsonl'}",
        "task.question_field=prompt", "task.answer_field=solution",
        f"task.eval_sets.mine.path={data / 'math_eval.jsonl'}", "task.eval_sets.mine.question_field=problem",
        "task.eval_sets.mine.answer_field=answer", "task.eval_sets.mine.max_prompts=3",
        f"task.eval_sets.own={tmp_path / 'own.jsonl'}"])
    suite = named_suite(cfg, task, "mine")
    assert [i.id for i in suite.items] == ["math_eval.jsonl:0", "math_eval.jsonl:1", "math_eval.jsonl:2"]
    assert suite.items[0].prompt == "What is 7 times 8?" + MATH_INSTRUCTION and suite.items[2].answer == "\\frac{5}{6}"
    assert task.reward(suite.items[2], "so \\boxed{5/6}", True) == 1.0
    assert [(i.prompt, i.answer) for i in named_suite(cfg, task, "own").items] == [
        ("What is 2+2?" + MATH_INSTRUCTION, "4")]  # null field names: the task's
