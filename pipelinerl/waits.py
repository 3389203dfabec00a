"""One wait line per period for many waiters of one thing (the requests no server of a pool may take).

Each waiting request used to log its own line every actor.wait_log_s, so a stall logged one line per waiting
request in the same few milliseconds (8 policy lines in 24 ms, 32 reward lines in 0.4 s). A `WaitLog` is shared
by all of them: they register while they wait and poll it, and it logs at most one line per period while at least
one waits, built when it is logged (how long the oldest has waited, how many wait, what the line callback reads
then). The callers pass the time (`now`), so the clock is theirs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator


class WaitLog:
    """The waiters of one thing. Its first line is due `every_s` after a wait begins while none was waiting, then
    at most one per `every_s` while any waits. `line(oldest_s, count, need)` builds the line: how long the oldest
    waiter has waited, how many wait, and what the oldest needs (as it registered it)."""

    def __init__(self, every_s: float, log: logging.Logger, line: Callable[[float, int, object], str]):
        self.every_s, self.log, self.line = every_s, log, line
        self.waiters: dict[object, tuple[float, object]] = {}  # key -> (when it began waiting, what it needs)
        self.due: float | None = None  # when the next line is due (None: no one waits)

    @contextlib.contextmanager
    def waiting(self, now: float, need: object = None) -> Iterator[None]:
        """One waiter, from `now` until the block ends."""
        key = object()
        if not self.waiters:
            self.due = now + self.every_s
        self.waiters[key] = (now, need)
        try:
            yield
        finally:
            del self.waiters[key]
            if not self.waiters:
                self.due = None

    def poll(self, now: float) -> None:
        """Log the line if one is due at `now` (any waiter may call this, as often as it likes)."""
        if self.due is None or now < self.due:
            return
        self.due = now + self.every_s
        since, need = min(self.waiters.values(), key=lambda w: w[0])
        self.log.warning("%s", self.line(now - since, len(self.waiters), need))
