"""Math grading throughput: completions graded per second by the grading pool for 1, 2 and 4 workers.

    .venv/bin/python tools/bench_grading.py [--completions 600] [--workers 1 2 4] [--summary PATH]

Completions are made up here: a few paragraphs of reasoning ending in a \\boxed{} answer that is right,
equivalent in another form, wrong, or missing. All are submitted at once (as the actor's threads do
under load) after the workers have started, so start-up (importing math-verify) is not timed.
"""

from __future__ import annotations

import argparse
import random
import time

from bench_summary import Summary

from pipelinerl.tasks.grading import GradingPool
from pipelinerl.tasks.math_task import _import_math_verify, grade_completion, job_timeout_s

# (gold, an equivalent form, a wrong answer)
ANSWERS = [("\\frac{1}{2}", "0.5", "\\frac{1}{3}"), ("\\sqrt{2}", "2^{1/2}", "\\sqrt{3}"),
           ("x^2+1", "1 + x^{2}", "x^2-1"), ("(0,1]", "(0, 1]", "[0,1]"), ("204", "204", "240"),
           ("\\frac{\\pi}{4}", "\\pi/4", "\\frac{\\pi}{2}")]
FILLER = "We consider the expression step by step, simplifying each term and checking the constraints. "


def completions(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        gold, same, wrong = rng.choice(ANSWERS)
        answer = rng.choice([gold, same, wrong, None])
        text = FILLER * rng.randint(5, 40) + (f"So the answer is \\boxed{{{answer}}}." if answer else "Done.")
        jobs.append((gold, text))
    return jobs


def graded_per_second(num_workers: int, jobs: list[tuple[str, str]], reward_timeout_s: int = 5) -> float:
    pool = GradingPool(num_workers, job_timeout_s(reward_timeout_s), grade_completion,
                       initializer=_import_math_verify)
    try:
        # Warm every worker (each must be initialised before it takes a job) and math-verify's caches.
        for future in [pool.submit(gold, text, reward_timeout_s) for gold, text in jobs[: 4 * num_workers]]:
            future.result()
        started = time.perf_counter()
        futures = [pool.submit(gold, text, reward_timeout_s) for gold, text in jobs]
        outcomes = [future.result() for future in futures]
        elapsed = time.perf_counter() - started
    finally:
        pool.close()
    assert "timeout" not in outcomes, "a job timed out: the bench would measure the timeout, not grading"
    return len(jobs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--completions", type=int, default=600)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--summary", default=None, help="also write the key rows there (tools/bench_summary.py)")
    args = parser.parse_args()
    summary = Summary("grading")
    jobs = completions(args.completions)
    rates = {n: graded_per_second(n, jobs) for n in args.workers}
    base = rates[args.workers[0]]
    print(f"{'workers':>8} {'graded/s':>10} {'vs ' + str(args.workers[0]):>8}")
    for n, rate in rates.items():
        print(f"{n:>8} {rate:>10.1f} {rate / base:>7.2f}x")
        summary.add(f"graded, {n} worker{'s' * (n > 1)}", rate, "graded/s")
    summary.write(args.summary)


if __name__ == "__main__":
    main()
