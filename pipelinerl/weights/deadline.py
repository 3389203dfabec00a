"""How long one phase of a delivery round may take before its silent members are set aside (straggler isolation).

Every member of a weight-update group takes part in each collective, so one member that stops (SIGSTOP, a long
GC pause, a swapping host) or crawls holds every other member on the old version for as long as the trainer
waits: the group's own timeout (inference.weight_update_timeout_s, 600 s), or until the launcher's health watch
kills it. Instead each phase (forming the group, one update round) gets a deadline from the measured time
of the recent successful ones:

    deadline = clamp(factor x median(recent times) + margin, floor, ceiling)

(trainer.delivery_deadline_*). A round's recent times are scaled up to its own size first (a dense round after
delta rounds moves more bytes; a smaller round keeps the measured time, mostly fixed costs). With no history
yet, or right after a phase that missed its deadline with no member late (the deadline was too short for a
healthy group), the ceiling applies. At the deadline the trainer abandons the round (collective.py's flag,
which a member waiting in a collective sees within ABORT_POLL_S). Late: a member that has not answered its
request LATE_GRACE_S after that (stopped); else one that had not finished while another had (slow, though
alive: it answered the abandonment). delivery.py backs a late one off and re-forms the group with the others
at once; it re-joins once its /status answers again (from the weights it holds: dense, or a delta only when its
base is the trainer's). A member that is alive and slow in a round of many buckets is not told apart: the
trainer sends bucket k + 2 only once bucket k reached everyone, so nobody finishes, every member answers,
and the round is retried with the ceiling, at that member's pace.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from pipelinerl.weights.wire import WeightTransferError

RECENT = 8  # successful phases the median is over: a few versions, so it follows a change of update size
# After abandoning a round, how long the members get to answer: a live member sees the flag within ABORT_POLL_S
# (0.5 s), resumes generation and replies; the rest is room for a loaded host.
LATE_GRACE_S = 3.0


@dataclass(frozen=True)
class DeadlineRule:
    """trainer.delivery_deadline_factor, _margin_s, _floor_s and _ceiling_s."""

    factor: float = 3.0
    margin_s: float = 2.0
    floor_s: float = 3.0
    ceiling_s: float = 120.0

    def __post_init__(self) -> None:
        if not (self.factor > 0 and self.margin_s >= 0 and 0 < self.floor_s <= self.ceiling_s):
            raise ValueError(f"a delivery deadline needs factor > 0, margin >= 0 and 0 < floor <= ceiling: {self}")


class PhaseDeadline:
    """The deadline of one phase kind (forming the group, or an update round) and its recent times."""

    def __init__(self, rule: DeadlineRule):
        self.rule = rule
        self._recent: deque[tuple[float, int]] = deque(maxlen=RECENT)  # (seconds, bytes) of successful ones
        self._widened = False

    def seconds(self, nbytes: int = 0) -> float:
        """The time a phase moving `nbytes` may take."""
        r = self.rule
        if not self._recent or self._widened:
            return r.ceiling_s
        expected = statistics.median(t * max(1.0, nbytes / b) if b else t for t, b in self._recent)
        return min(max(r.factor * expected + r.margin_s, r.floor_s), r.ceiling_s)

    def record(self, seconds: float, nbytes: int = 0) -> None:
        """A phase that succeeded in `seconds`."""
        self._recent.append((seconds, nbytes))
        self._widened = False

    def widen(self) -> None:
        """The last phase missed its deadline though every member answered: the next one gets the ceiling."""
        self._widened = True


class MembersLate(WeightTransferError):
    """A phase of a round missed its deadline and was abandoned. `late`: the members still silent LATE_GRACE_S
    after that (empty: every member answered, so the deadline was too short); `answered`: the others' replies
    (a dict) or errors (an exception), from which their version is known."""

    def __init__(self, message: str, late: list[str], answered: dict[str, dict | Exception]):
        super().__init__(message)
        self.late, self.answered = late, answered
