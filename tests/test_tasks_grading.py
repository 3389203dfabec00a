"""The grading pool: timeouts count from a job's start, an overdue worker is replaced, nothing else is lost."""

import time

import pytest

from pipelinerl.tasks.grading import GradingPool


def fake_grade(gold: str, completion: str) -> str:
    """Module-level so that the spawned workers can import it: 'sleep:S' sleeps S seconds first."""
    if completion.startswith("sleep:"):
        time.sleep(float(completion.split(":")[1]))
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
    pool = pool_factory(1, timeout_s=1.5)
    pool.grade("0", "0")
    jobs = [pool.submit("7", "sleep:0.5") for _ in range(5)]  # 2.5 s queued in all, 0.5 s each
    assert [job.result() for job in jobs] == ["wrong"] * 5 and pool.timeouts == 0


def test_other_workers_keep_running_jobs_while_one_is_replaced(pool_factory):
    pool = pool_factory(2, timeout_s=2.0)
    assert [pool.grade("0", "0") for _ in range(2)] == ["correct"] * 2
    slow = pool.submit("7", "sleep:30")
    middling = pool.submit("7", "sleep:1")  # runs on the other worker, across the slow one's kill
    innocents = [pool.submit(str(i), str(i)) for i in range(20)]
    assert slow.result() == "timeout" and middling.result() == "wrong"
    assert [job.result() for job in innocents] == ["correct"] * 20 and pool.timeouts == 1


def test_grader_error_reaches_the_caller_and_close_reopens(pool_factory):
    pool = pool_factory(1, timeout_s=5.0, fn=failing_grade)
    with pytest.raises(RuntimeError, match="KeyError"):
        pool.grade("a", "b")
    pool.close()
    with pytest.raises(RuntimeError, match="KeyError"):  # reopened on the next submit
        pool.grade("a", "b")
