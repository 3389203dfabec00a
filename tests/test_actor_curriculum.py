"""The difficulty curriculum's rule (pipelinerl/actor/curriculum.py), pure; the actor's exact resume of it is in
tests/test_actor.py."""

import itertools
from pathlib import Path

import pytest

from pipelinerl.actor.curriculum import Curriculum
from pipelinerl.config import load_config
from pipelinerl.config.fields import ConfigError
from pipelinerl.tasks import PromptItem

REPO = Path(__file__).resolve().parent.parent
ITEMS = [PromptItem(id=f"p{i}", prompt=f"q{i}", answer=str(i)) for i in range(10)]


def _curriculum(min_groups: int = 2, weight: float = 0.1) -> Curriculum:
    return Curriculum(ITEMS, seed=3, min_groups=min_groups, weight=weight, is_success=lambda r: r >= 1.0)


def test_a_prompt_always_or_never_solved_in_enough_groups_gets_the_low_weight():
    c = _curriculum()
    c.record("p0", [1.0, 1.0])  # solved by every attempt, but one group only
    c.record("p1", [0.0, 0.0])
    c.record("p2", [1.0, 0.0])
    assert [c.weight_of(p) for p in ("p0", "p1", "p2", "p9")] == [1.0, 1.0, 1.0, 1.0]
    c.record("p0", [1.0, 1.0, 1.0])
    c.record("p1", [0.0])
    c.record("p2", [1.0, 1.0])  # 3 of 4 over its two groups: learnable
    assert [c.weight_of(p) for p in ("p0", "p1", "p2", "p9")] == [0.1, 0.1, 1.0, 1.0]
    assert c.saturated_fraction() == 0.2 and sorted(c.pass_rates()) == [0.0, 0.75, 1.0]
    c.record("p0", [0.0])  # one failure: no longer always solved
    assert c.weight_of("p0") == 1.0 and c.counts["p0"].pass_rate == 5 / 6


def test_draws_are_weighted_and_a_pure_function_of_seed_number_and_counts():
    c = _curriculum(min_groups=1)
    for item in ITEMS[:5]:
        c.record(item.id, [1.0])
    draws = [c.item(k).id for k in range(5000)]
    saturated = sum(d in {"p0", "p1", "p2", "p3", "p4"} for d in draws) / len(draws)
    assert saturated == pytest.approx(5 * 0.1 / (5 * 0.1 + 5), abs=0.015)  # 0.091
    same = _curriculum(min_groups=1)
    for item in ITEMS[:5]:
        same.record(item.id, [1.0])
    assert [same.item(k).id for k in range(5000)] == draws
    assert [c.item(k).id for k in range(100, 110)] == [x.id for x in itertools.islice(same.iter_train(100), 10)]
    plain = _curriculum(min_groups=1)  # no counts: every prompt weight 1
    assert sum(plain.item(k).id in {"p0", "p1", "p2", "p3", "p4"} for k in range(5000)) / 5000 == pytest.approx(
        0.5, abs=0.03)


@pytest.mark.parametrize(("overrides", "message"), [
    (["task.curriculum=pass_rate", "streams.retention=delete"], "set streams.retention=keep"),
    (["task.curriculum=easy_first"], "task.curriculum"),
    (["task.curriculum=pass_rate", "task.curriculum_weight=0"], "must be in \\(0, 1\\]"),
    (["task.curriculum=pass_rate", "task.curriculum_min_groups=0"], "task.curriculum_min_groups"),
])
def test_bad_curriculum_settings_are_refused(overrides, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        load_config(REPO / "configs" / "tiny_cpu.yaml", [f"run_dir={tmp_path}", *overrides])
