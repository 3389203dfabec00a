"""pipelinerl/actor/pacing.py: episodes take their turns in arrival order, at most TURNS_PER_ITERATION per iteration
of the event loop, whatever the number waiting."""

import asyncio

from pipelinerl.actor.pacing import TURNS_PER_ITERATION, Pacer, take_turn


class _Iterations:
    """Counts the loop's iterations: a callback that schedules itself again runs once per iteration."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.count, self.running = loop, 0, True
        loop.call_soon(self._tick)

    def _tick(self) -> None:
        self.count += 1
        if self.running:
            self.loop.call_soon(self._tick)


def test_waiters_pass_in_arrival_order_a_batch_per_iteration():
    async def main() -> list[tuple[int, int]]:
        loop = asyncio.get_running_loop()
        pacer, iterations, passed = Pacer(loop, per_iteration=4), _Iterations(loop), []

        async def episode(k: int) -> None:
            await pacer.take_turn()
            passed.append((k, iterations.count))

        await asyncio.gather(*map(episode, range(50)))
        iterations.running = False
        return passed

    passed = asyncio.run(main())
    assert [k for k, _ in passed] == list(range(50))
    per_iteration = {}
    for _, iteration in passed:
        per_iteration[iteration] = per_iteration.get(iteration, 0) + 1
    assert max(per_iteration.values()) == 4 and len(per_iteration) == 13  # 12 batches of 4, then 2


def test_a_cancelled_waiter_takes_no_place_in_a_batch():
    async def main() -> list[tuple[int, int]]:
        loop = asyncio.get_running_loop()
        pacer, iterations, passed = Pacer(loop, per_iteration=2), _Iterations(loop), []

        async def episode(k: int) -> None:
            await pacer.take_turn()
            passed.append((k, iterations.count))

        tasks = [asyncio.ensure_future(episode(k)) for k in range(4)]
        await asyncio.sleep(0)  # all four wait, their first batch not yet let through
        tasks[0].cancel()
        await asyncio.gather(*tasks[1:])
        iterations.running = False
        return passed

    (one, first), (two, second), (three, third) = asyncio.run(main())
    assert (one, two, three) == (1, 2, 3) and first == second < third


def test_each_event_loop_has_its_own_pacer():
    """Episodes on a second loop pass, after a first loop that ended with one of them waiting."""
    async def end_while_waiting() -> None:
        asyncio.ensure_future(take_turn())

    async def turns() -> None:
        await asyncio.gather(*(take_turn() for _ in range(3 * TURNS_PER_ITERATION)))

    asyncio.run(end_while_waiting())
    asyncio.run(asyncio.wait_for(turns(), 30))
