"""Turns taken in order: at most TURNS_PER_ITERATION episode turns start per iteration of the actor's event loop.

The actor runs every episode on one event loop, and asyncio runs, in each iteration, every callback that was ready
when it began. When thousands of episodes become ready at once (the actor starts its groups, or a server answers
a batch of requests together), one iteration ran all their turns (rendering, tokenizing, the next request): with
10,000 episodes, seconds in which no timer, probe, version poll or stream write of the actor ran
(tools/bench_actor_scale.py: a p99 lag of 5 to 10 s). An episode now waits for its turn (`take_turn`) before its first
turn and after each completion: the waiters are let through in arrival order, TURNS_PER_ITERATION per iteration,
so an iteration starts at most that many turns whatever the number of episodes. The loop stays as busy, and the
order of episodes is first come, first served. Not paced: the reading of replies that arrive together (the loop
reads every socket that is ready when an iteration begins) and the garbage collector's pauses (transport.py).
"""

from __future__ import annotations

import asyncio
import collections
import weakref

# One turn of the tiny tool task costs the actor about 1 ms of CPU (tools/bench_actor_scale.py): 16 turns keep an
# iteration, and so the loop's lag, in the tens of milliseconds.
TURNS_PER_ITERATION = 16


class Pacer:
    """The waiters of one event loop, let through `per_iteration` at a time, one batch per loop iteration."""

    def __init__(self, loop: asyncio.AbstractEventLoop, per_iteration: int = TURNS_PER_ITERATION):
        self.loop, self.per_iteration = loop, per_iteration
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self.scheduled = False  # a batch is due at the next iteration

    async def take_turn(self) -> None:
        waiter = self.loop.create_future()
        self.waiters.append(waiter)
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self._let_through)
        await waiter

    def _let_through(self) -> None:
        """Wake the next batch (a waiter cancelled meanwhile takes no place in it); the rest wait for the next
        iteration: a callback scheduled now runs after every callback this iteration already holds."""
        woken = 0
        while self.waiters and woken < self.per_iteration:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                woken += 1
        self.scheduled = bool(self.waiters)
        if self.scheduled:
            self.loop.call_soon(self._let_through)


_PACERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Pacer] = weakref.WeakKeyDictionary()


async def take_turn() -> None:
    """Wait for this episode's turn on the running loop's Pacer."""
    loop = asyncio.get_running_loop()
    pacer = _PACERS.get(loop)
    if pacer is None:
        pacer = _PACERS[loop] = Pacer(loop)
    await pacer.take_turn()
