"""How long vLLM's engine core and its workers spin while they wait for each other (inference.engine_spin_s).

The engine core hands each step to its workers, and they answer, through shared-memory queues. A reader of one
(`SpinCondition`, vllm/distributed/device_communicators/shm_broadcast.py) busy-waits on it, calling
sched_yield, for `busy_loop_s` (1 s) after its last message before it sleeps on the queue's notification
socket; steps come every few milliseconds, so the engine core and every worker spin between any two steps. On a
GPU node that buys latency with spare cores; on CPU the spin takes the cores that the steps, the API server, the
actor and the trainer run on (profiled on the tiny 2-core run: 60 % of the worker's CPU and 68 % of the engine
core's was the spin, a third of the machine).

`pipelinerl serve` puts the spin in SPIN_ENV before vLLM starts its processes; the plugin (`register`, in every
vLLM process) then makes every reader created afterwards spin that long, and sleep on the socket at most
RECHECK_MS at a time before it looks at the queue again. The writer notifies the socket at every message, but
notifications get lost (a PUB socket with a high-water mark of 1 drops one while the last is unread): vLLM's
reader then sleeps its full recheck interval, 5 s, with a message waiting. Measured on the tiny run without the
cap: steps of 10 s, weight deliveries of 15 s. With it a lost notification costs at most RECHECK_MS, and an idle
reader wakes 1000 times a second (a few microseconds each) instead of spinning.
"""

from __future__ import annotations

import os

SPIN_ENV = "PIPELINERL_ENGINE_SPIN_S"  # seconds; unset: vLLM's own spin and recheck interval
RECHECK_MS = 1  # the longest a reader that does not spin sleeps before it looks at its queue again


def apply_spin() -> None:
    """Make vLLM's shared-memory queue readers spin SPIN_ENV seconds, then sleep in RECHECK_MS slices (nothing when
    SPIN_ENV is unset)."""
    value = os.environ.get(SPIN_ENV)
    if value is None:
        return
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    spin_s = float(value)
    init = getattr(SpinCondition.__init__, "__wrapped__", SpinCondition.__init__)  # register may run twice
    wait = getattr(SpinCondition.wait, "__wrapped__", SpinCondition.wait)

    def spinning_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.is_reader:
            self.busy_loop_s = spin_s

    def rechecking_wait(self, timeout_ms: int | None = None) -> None:
        wait(self, RECHECK_MS if timeout_ms is None else min(timeout_ms, RECHECK_MS))

    spinning_init.__wrapped__, rechecking_wait.__wrapped__ = init, wait
    SpinCondition.__init__, SpinCondition.wait = spinning_init, rechecking_wait
