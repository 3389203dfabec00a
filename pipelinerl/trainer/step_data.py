"""Each optimizer step's rollout groups, split exactly over the trainer ranks.

Rank 0 alone reads the stream: it takes the next `samples_per_step / G` groups in stream order and
scatters `groups / W` of them to every rank (torch.distributed scatter_object_list). Every step is
then exactly the next S samples of the stream whatever the number of actors, segments, ranks and
attempts, which is what the actor's lag throttle assumes (sample i is trained at step floor(i / S)).
Rules that let each rank pick its own groups per segment drift apart: one rank waits for data that the
actor, stopped at its sample bound, never writes. One cursor, rank 0's, is the run's stream position,
so a checkpoint resumes exactly, at any rank count.

While rank 0 waits for data the others wait in the scatter, so rank 0 answers every step in bounded
time: with the groups, with `stop` when a stop signal (SIGTERM / SIGUSR1) arrives during the wait, or
with the reason it starved once trainer.data_timeout_s has passed (less than dist_timeout_s, so no
collective times out first), or with `failed` when rank 0's weight delivery gave up (weights/delivery.py
escalation). Every rank then acts on the same answer. A wait longer than trainer.wait_log_s is logged, and
again every wait_log_s: the groups read, the stream's writers, every server's version read then, and which
servers the newest published version has not reached since when (`delivery_now`).
"""

from __future__ import annotations

import functools
import logging
import time

import pyarrow as pa

from pipelinerl.config import Config
from pipelinerl.trainer.dist import DistInfo

log = logging.getLogger(__name__)

WAIT_SLICE_S = 1.0  # rank 0 looks at its stop flag at least this often while waiting for data
# The wait line's read of every server's /status, all at once: a stopped server holds rank 0 this long, once
# per trainer.wait_log_s.
STATUS_TIMEOUT_S = 3.0


class StreamStarved(TimeoutError):
    """A step's data did not arrive within trainer.data_timeout_s; the message says what was awaited."""


def split_groups(tokens: list[int], world: int) -> list[list[int]]:
    """Indexes of `tokens` (one total per group) for each of `world` ranks: exactly len / world each,
    token totals balanced greedily (longest group first to the lightest rank that still has room), each
    rank's indexes in stream order. Deterministic: ties go to the lower index and the lower rank."""
    assert len(tokens) % world == 0, (len(tokens), world)
    per_rank = len(tokens) // world
    shares: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        rank = min((r for r in range(world) if len(shares[r]) < per_rank), key=lambda r: (load[r], r))
        shares[rank].append(i)
        load[rank] += tokens[i]
    return [sorted(share) for share in shares]


def group_tokens(batch: pa.RecordBatch) -> int:
    """Prompt + completion tokens of one group (what a rank's forward pass costs)."""
    return sum(len(p) + len(c) for p, c in zip(batch.column("prompt_token_ids").to_pylist(),
                                              batch.column("completion_token_ids").to_pylist()))


class StepData:
    """The trainer's view of the rollout stream: `next_step()` on every rank, in step."""

    def __init__(self, cfg: Config, dist: DistInfo, cursor: dict | None, stop_flag, delivery=None, status=None):
        """`stop_flag()` is true once this process received a stop signal; `delivery` (a weights.Delivery): its
        `failure` stops every rank and `describe()` goes into the wait logs (both read on rank 0 only); `status` (a
        rundir.StatusFile, rank 0): where a wait for data is recorded while it lasts."""
        from pipelinerl.streams import ROLLOUT_TOPIC, StreamReader

        self.cfg, self.dist, self.stop_flag, self.delivery, self.status = cfg, dist, stop_flag, delivery, status
        self.groups = cfg.trainer.samples_per_step // cfg.actor.attempts
        self.reader = StreamReader(cfg.run_dir, ROLLOUT_TOPIC, cfg.streams, cursor=cursor) if dist.is_main else None

    def cursor(self) -> dict | None:
        """The stream position after the last step handed out (rank 0; None elsewhere)."""
        return self.reader.cursor() if self.reader is not None else None

    def next_step(self, step: int) -> list[pa.RecordBatch] | None:
        """This rank's groups of the next step, or None when a stop signal came while rank 0 waited.
        Raises StreamStarved on every rank when the data did not come in time."""
        answer = self._read(step) if self.dist.is_main else None
        if self.status is not None:
            self.status.done_waiting()
        if self.dist.world_size > 1:
            answer = _scatter(answer)
        elif answer is not None:
            answer = answer[0]
        kind, payload = answer
        if kind == "starved":
            raise StreamStarved(payload)
        if kind == "failed":
            from pipelinerl.weights import DeliveryFailed

            raise DeliveryFailed(payload)
        return payload if kind == "groups" else None

    def _read(self, step: int) -> list[tuple[str, object]]:
        """Rank 0: one (kind, payload) per rank: ("groups", batches) | ("stop", None) | ("starved", why) |
        ("failed", why)."""
        world, started = self.dist.world_size, time.monotonic()
        deadline = started + self.cfg.trainer.data_timeout_s
        next_log = started + self.cfg.trainer.wait_log_s
        before = self.reader.cursor()
        batches: list[pa.RecordBatch] = []
        while len(batches) < self.groups:
            if self.delivery is not None and self.delivery.failure is not None:
                return [("failed", str(self.delivery.failure))] * world
            if time.monotonic() >= next_log:
                next_log += self.cfg.trainer.wait_log_s
                log.warning("step %d has waited %.0f s for its data: %d of %d groups read from %s; writers seen: %s; "
                            "weight delivery: %s", step, time.monotonic() - started, len(batches), self.groups,
                            self.reader.dir, self.reader.writers_seen() or "none",
                            delivery_now(self.delivery) if self.delivery is not None else "none on this rank")
            if self.stop_flag():
                log.info("stop signal while waiting for step %d's data (%d of %d groups read)", step,
                         len(batches), self.groups)
                return [("stop", None)] * world
            if self.status is not None:
                self.status.waiting(f"the rollouts of step {step + 1}", groups_read=len(batches), groups=self.groups)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return [("starved", self._starved_message(step, len(batches), before))] * world
            batches += self._read_some(self.groups - len(batches), min(WAIT_SLICE_S, remaining))
        shares = split_groups([group_tokens(b) for b in batches], world)
        return [("groups", [batches[i] for i in share]) for share in shares]

    def _read_some(self, n: int, timeout_s: float) -> list[pa.RecordBatch]:
        from pipelinerl.streams import StreamTimeout

        try:
            return self.reader.read_groups(n, timeout_s)
        except StreamTimeout:
            return []

    def _starved_message(self, step: int, have: int, before: dict) -> str:
        G = self.cfg.actor.attempts
        return (f"trainer step {step} waited {self.cfg.trainer.data_timeout_s:.0f} s (trainer.data_timeout_s) for "
                f"{self.groups} groups of {G} samples from {self.reader.dir} and got {have}; stream cursor at the "
                f"step's start: {before['next'] or 'the beginning'}; writers seen: "
                f"{self.reader.writers_seen() or 'none'}. Is the actor running and are the servers answering? "
                f"See RUN_DIR/logs/actor.log")


def delivery_now(delivery) -> str:
    """What weight delivery (a weights.Delivery) is doing, with every server's version as the server reports it
    now (GET /status, all at once, STATUS_TIMEOUT_S in all). Delivery's own record of a server changes only when its
    round ends, so during a round stuck on one member it shows the members that did load the version at the one
    before. Each server not at the newest published version is named with that version's age and delivery's
    record of its failures."""
    import concurrent.futures

    from pipelinerl.weights.collective import on_thread

    states, timeout_s = delivery.server_states(), STATUS_TIMEOUT_S
    with delivery.publication.lease() as snap:
        latest, published_at = (None, 0.0) if snap is None else (snap.version, snap.published_at)
    asked = [on_thread(functools.partial(delivery.control.status, s.url, timeout_s), "wait-line-status")
             for s in states]
    concurrent.futures.wait(asked, timeout=timeout_s)
    now = time.monotonic()
    head = ("nothing published yet" if latest is None
            else f"version {latest} published {now - published_at:.0f} s ago")
    servers = [_server_now(s, f, latest, now - published_at, timeout_s, now) for s, f in zip(states, asked)]
    return f"{head}; servers: {'; '.join(servers) or 'none announced in RUN_DIR/servers'}"


def _server_now(s, asked, latest: int | None, published_s: float, timeout_s: float, now: float) -> str:
    """One server of `delivery_now`: s, delivery's record of it (weights.delivery.ServerState); asked, the future
    of its /status read."""
    if not asked.done():
        version, said = s.version, f" (no answer to GET /status within {timeout_s:.0f} s: delivery's last record)"
    elif asked.exception() is not None:
        version, said = s.version, f" ({asked.exception()}: delivery's last record)"
    else:
        version, said = asked.result().version, ""
    line = f"{s.url} {'version unknown' if version is None else f'at version {version}'}{said}"
    if latest is not None and version != latest:
        line += f", stuck: version {latest}, published {published_s:.0f} s ago, has not reached it"
    if s.failures:
        line += (f", failing for {now - s.failing_since:.0f} s ({s.failures} failed attempt(s), last: "
                 f"{s.last_error[:200]})")
    if s.retry_at > now:
        line += f", retry in {s.retry_at - now:.0f} s"
    return line


def _scatter(answer: list | None):
    import torch.distributed as tdist

    out = [None]
    tdist.scatter_object_list(out, answer, src=0)
    return out[0]
