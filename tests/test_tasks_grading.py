"""The grading pool: timeouts count from a job's start, an overdue worker is replaced, nothing else is lost."""

import time
from pathlib import Path

import pytest

from pipelinerl.tasks.grading import GradingPool


def fake_grade(gold: str, completion: str) -> str:
    """Module-level so that the spawned workers can import it: 'sleep:S' sleeps S seconds first; 'until:PATH'
    creates PATH.started, then waits (bounded) until the test creates PATH."""
    if completion.startswith("sleep:"):
        time.sleep(float(completion.split(":")[1]))
        return "wrong"
    if completion.startswith("until:"):
        gate = Path(completion.split(":", 1)[1])
        gate.with_suffix(".started").touch()
        deadline = time.monotonic() + 120
        while not gate.exists():
            if time.monotonic() > deadline:
                return "the gate never opened"
            time.sleep(0.01)
        return "wrong"
    return "correct" if completion == gold else "wrong"


def failing_grade(gold: str, completion: str) -> str:
    raise KeyError(gold)


@pytest.fixture
def pool_factory():
    pools = []

    def make(num_workers, timeout_s, fn=fake_grade):
        pools.append(GradingPool(num_workers, timeout_s, fn))
        return pools[-1]

    yield make
    for pool in pools:
        pool.close()


def test_innocent_sample_behind_a_slow_one_still_scores(pool_factory):
    pool = pool_factory(1, timeout_s=1.0)
    assert pool.grade("7", "7") == "correct"  # the worker is up: timings below exclude start-up
    pid = pool.worker_pids()[0]
    started = time.monotonic()
    slow, innocent = pool.submit("7", "sleep:30"), pool.submit("7", "7")
    assert slow.result() == "timeout" and innocent.result() == "correct"
    assert time.monotonic() - started < 10  # the slow one was cut at ~1 s, not after its 30 s
    assert pool.worker_pids()[0] != pid and pool.timeouts == 1
    assert [pool.grade("1", "1"), pool.grade("1", "2")] == ["correct", "wrong"]  # the replacement grades


def test_timeout_counts_from_job_start_not_from_queueing(pool_factory):
    pool = pool_factory(1, timeout_s=3.0)
    pool.grade("0", "0")
    # 0.5 s each (2.5 s under the timeout: a loaded machine's slack), 5 s queued in all: a clock started at
    # queueing would cut the last ones (the seventh ends 3.5 s after it was queued)
    jobs = [pool.submit("7", "sleep:0.5") for _ in range(10)]
    assert [job.result() for job in jobs] == ["wrong"] * 10 and pool.timeouts == 0


def _wait_for(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def test_other_workers_keep_running_jobs_while_one_is_replaced(pool_factory, tmp_path):
    """`middling` runs on one worker across the kill of the other, by construction: it waits for a gate the test
    opens only after the kill, and its deadline is far (the pool's timeout when it was handed out); the slow job,
    handed out once the timeout is short, is cut. Jobs queued meanwhile run on the replacement."""
    pool = pool_factory(2, timeout_s=60.0)
    assert [pool.grade("0", "0") for _ in range(2)] == ["correct"] * 2
    gate = tmp_path / "gate"
    middling = pool.submit("7", f"until:{gate}")
    _wait_for(gate.with_suffix(".started"))  # running, with a deadline 60 s away
    pool.timeout_s = 1.0  # for the jobs handed out from now on
    slow = pool.submit("7", "sleep:30")  # on the other worker
    assert slow.result() == "timeout" and not middling.done()  # its worker was killed while middling ran
    pool.timeout_s = 60.0
    innocents = [pool.submit(str(i), str(i)) for i in range(20)]  # the other worker is still busy: the replacement
    assert [job.result() for job in innocents] == ["correct"] * 20 and not middling.done()
    gate.touch()
    assert middling.result() == "wrong" and pool.timeouts == 1


def test_grader_error_reaches_the_caller_and_close_reopens(pool_factory):
    pool = pool_factory(1, timeout_s=5.0, fn=failing_grade)
    with pytest.raises(RuntimeError, match="KeyError"):
        pool.grade("a", "b")
    pool.close()
    with pytest.raises(RuntimeError, match="KeyError"):  # reopened on the next submit
        pool.grade("a", "b")
