"""A pool of grading processes with a per-job timeout that starts when a worker starts the job.

Why not multiprocessing.Pool or ProcessPoolExecutor: neither can kill the one worker stuck on a
pathological answer; Pool's timeout is the caller's wait (so time spent queued counts against a job)
and ProcessPoolExecutor breaks the whole pool when a worker dies. Here each worker has its own pipe,
the parent hands a job only to an idle, initialised worker (so the job starts when it is sent), and a
dispatcher thread kills an overdue worker and starts a replacement; the other workers and the queued
jobs are untouched. Callers get a concurrent.futures.Future per job.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobResult:
    """What a worker sends back for one job: the grader's value, or the repr of what it raised."""

    job_id: int
    ok: bool
    value: Any


def _worker_main(conn: Connection, grade_fn: Callable, initializer: Callable | None) -> None:
    """A worker: initialise, say ready (None), then answer one job at a time until told to stop."""
    if initializer is not None:
        initializer()
    conn.send(None)
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        job_id, args = job
        try:
            conn.send(JobResult(job_id, True, grade_fn(*args)))
        except Exception as error:  # noqa: BLE001 - the caller decides; the worker keeps serving
            conn.send(JobResult(job_id, False, repr(error)))


@dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: Connection
    ready: bool = False
    job: tuple[int, Future] | None = None  # the job it runs, with its future
    deadline: float = 0.0  # time.monotonic() by which the job must answer


@dataclass
class _Job:
    job_id: int
    args: tuple
    future: Future = field(default_factory=Future)


class GradingPool:
    """`num_workers` processes running the module-level `grade_fn(*args)`; thread-safe.

    A job running longer than `timeout_s` in its worker resolves to `timeout_value` and its worker is
    replaced. The pool starts on the first submit and again after close().
    """

    def __init__(self, num_workers: int, timeout_s: float, grade_fn: Callable, *,
                 initializer: Callable | None = None, timeout_value: Any = "timeout"):
        assert num_workers >= 1 and timeout_s > 0
        self.num_workers, self.timeout_s, self.timeout_value = num_workers, timeout_s, timeout_value
        self.grade_fn, self.initializer = grade_fn, initializer
        self.timeouts = 0  # jobs cut by the timeout since the pool was built (all openings)
        self._ctx = multiprocessing.get_context("spawn")  # the actor has threads: never fork it
        self._lock = threading.Lock()
        self._pending: collections.deque[_Job] = collections.deque()
        self._next_id = 0
        self._thread: threading.Thread | None = None
        self._stop = False

    def submit(self, *args) -> Future:
        """Queue grade_fn(*args); the future holds its value, or timeout_value."""
        with self._lock:
            if self._thread is None:
                self._open()
            job = _Job(self._next_id, args)
            self._next_id += 1
            self._pending.append(job)
            self._wake_w.send_bytes(b"")
        return job.future

    def grade(self, *args) -> Any:
        """submit(*args) and wait for it."""
        return self.submit(*args).result()

    def worker_pids(self) -> list[int | None]:
        """The live workers' process ids (for tests: a replaced worker has a new one)."""
        with self._lock:
            return [w.process.pid for w in getattr(self, "_workers", [])]

    def close(self) -> None:
        """Stop the workers; queued jobs fail with RuntimeError. A later submit reopens the pool."""
        with self._lock:
            if self._thread is None:
                return
            self._stop = True
            self._wake_w.send_bytes(b"")
            thread = self._thread
        thread.join()
        with self._lock:
            for worker in self._workers:
                self._kill(worker)
                if worker.job is not None:
                    worker.job[1].set_exception(RuntimeError("grading pool closed"))
            while self._pending:
                self._pending.popleft().future.set_exception(RuntimeError("grading pool closed"))
            self._wake_r.close()
            self._wake_w.close()
            self._thread, self._stop, self._workers = None, False, []

    # Everything below runs under self._lock or in the dispatcher thread.

    def _open(self) -> None:
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._workers = [self._start_worker() for _ in range(self.num_workers)]
        self._thread = threading.Thread(target=self._dispatch, name="grading-pool", daemon=True)
        self._thread.start()

    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_worker_main, args=(child, self.grade_fn, self.initializer),
                                    daemon=True)
        process.start()
        child.close()
        return _Worker(process, parent)

    @staticmethod
    def _kill(worker: _Worker) -> None:
        worker.process.kill()
        worker.process.join()
        worker.conn.close()

    def _dispatch(self) -> None:
        """Hand jobs to idle workers, collect answers, replace overdue or dead workers."""
        while True:
            with self._lock:
                if self._stop:
                    return
                self._assign()
                busy = [w.deadline for w in self._workers if w.job is not None]
                conns = [self._wake_r] + [w.conn for w in self._workers]
            timeout = max(0.0, min(busy) - time.monotonic()) if busy else None
            ready = wait(conns, timeout)
            with self._lock:
                if self._wake_r in ready:
                    while self._wake_r.poll():
                        self._wake_r.recv_bytes()
                for index, worker in enumerate(self._workers):
                    if worker.conn in ready:
                        self._receive(index, worker)
                self._replace_overdue()

    def _assign(self) -> None:
        for worker in self._workers:
            if worker.ready and worker.job is None and self._pending:
                job = self._pending.popleft()
                worker.conn.send((job.job_id, job.args))
                worker.job, worker.deadline = (job.job_id, job.future), time.monotonic() + self.timeout_s

    def _receive(self, index: int, worker: _Worker) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):  # the worker died (a crash in C code): replace it, fail its job
            self._workers[index] = self._start_worker()
            if worker.job is not None:
                worker.job[1].set_exception(RuntimeError(
                    f"grading worker {worker.process.pid} died (exit code {worker.process.exitcode})"))
            self._kill(worker)
            return
        if message is None:
            worker.ready = True
            return
        assert worker.job is not None and message.job_id == worker.job[0], "answer to a job it was not given"
        future, worker.job = worker.job[1], None
        if message.ok:
            future.set_result(message.value)
        else:
            future.set_exception(RuntimeError(f"grader raised {message.value}"))

    def _replace_overdue(self) -> None:
        now = time.monotonic()
        for index, worker in enumerate(self._workers):
            if worker.job is not None and now >= worker.deadline:
                log.warning("grading job %d ran over %.1f s: worker %d killed and replaced",
                            worker.job[0], self.timeout_s, worker.process.pid)
                self._kill(worker)
                self.timeouts += 1
                worker.job[1].set_result(self.timeout_value)
                self._workers[index] = self._start_worker()
