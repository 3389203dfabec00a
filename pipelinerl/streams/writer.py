"""StreamWriter: one per actor process; buffers whole groups and publishes them as segments."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from pipelinerl.config import StreamsConfig
from pipelinerl.streams.schema import Rollout, group_batch
from pipelinerl.streams.segments import (
    WriterTotals,
    check_name,
    highest_seq,
    publish,
    temp_files,
    topic_dir,
    writer_totals,
)

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations are not evaluated at runtime

log = logging.getLogger(__name__)

Row = Rollout | Mapping[str, Any]


class StreamWriter:
    """Appends rollout groups to RUN_DIR/streams/<topic>/<writer_id>/.

    A segment is sealed when it reaches `segment_max_rows` rows or `segment_max_bytes` bytes, or when
    its oldest group has waited `segment_max_seconds` (so an actor idling in the lag throttle cannot hold
    back the samples the trainer needs to advance). A background thread publishes sealed segments in
    sequence order (encoding, CRC-32 and fsync release the GIL: the actor keeps converting the next
    groups meanwhile); at most one sealed segment waits, so a slow disk slows `write_group` down instead
    of filling memory. A failed publish is raised by the next `write_group`, `flush` or `close`, and
    nothing after it is published: the stream stays a gap-free prefix of what was written.
    A group always lands in one segment; a single group larger than the limits makes one large segment.
    `writer_id` must be unique among live writers; a restarted writer with the same id continues the
    sequence numbers and the totals (segments.WriterTotals) and deletes the temporary file its dead
    predecessor left behind.
    """

    def __init__(self, run_dir: str | os.PathLike, topic: str, writer_id: str, cfg: StreamsConfig):
        self.cfg = cfg
        self.dir = topic_dir(run_dir, topic) / check_name("writer_id", writer_id)
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in temp_files(self.dir):  # unpublished data of a killed predecessor: never visible
            log.warning("removing unpublished temporary segment %s left by a previous writer", stale)
            stale.unlink(missing_ok=True)
        self._seq = highest_seq(self.dir) + 1
        self._totals = writer_totals(self.dir)  # through the last sealed segment
        self._batches: list[pa.RecordBatch] = []  # the segment being filled
        self._rows = 0
        self._bytes = 0
        self._oldest: float | None = None  # monotonic time the oldest buffered group arrived
        self._sealed: deque[tuple[int, list[pa.RecordBatch], WriterTotals]] = deque()  # to publish, in order
        self._cond = threading.Condition()  # guards every field above and below
        self._error: BaseException | None = None  # a failed background publish, re-raised on write
        self._stop = False
        self._closed = False
        self.segments_published = 0
        self._thread = threading.Thread(target=self._publish_in_background, name=f"stream-writer-{writer_id}",
                                        daemon=True)
        self._thread.start()

    def write(self, row: Row) -> None:
        """One sample as a group of its own (prefer `write_group`: the trainer needs whole groups)."""
        self.write_group([row])

    def write_group(self, rows: Sequence[Row]) -> None:
        """Validate and buffer the G attempts of one prompt. A bad row raises ValueError and the group
        is refused whole; what was buffered before stays."""
        batch = group_batch(rows)  # outside the lock: conversion is the costly part
        with self._cond:
            self._check_usable()
            limit = self.cfg
            if self._batches and (self._rows + batch.num_rows > limit.segment_max_rows
                                  or self._bytes + batch.nbytes > limit.segment_max_bytes):
                self._seal_locked()
            self._batches.append(batch)
            self._rows += batch.num_rows
            self._bytes += batch.nbytes
            if self._oldest is None:
                self._oldest = time.monotonic()
                self._cond.notify_all()  # the background thread now has a deadline to keep
            if self._rows >= limit.segment_max_rows or self._bytes >= limit.segment_max_bytes:
                self._seal_locked()

    def flush(self) -> None:
        """Publish what is buffered now, and wait until it is published."""
        with self._cond:
            self._check_usable()
            if self._batches:
                self._seal_locked()
            self._cond.wait_for(lambda: not self._sealed or self._error is not None)
            self._check_usable()

    def close(self) -> None:
        """Publish what is buffered and stop the background thread."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            self._thread.join()
            self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError(f"stream writer {self.dir} is closed")
        if self._error is not None:
            raise RuntimeError(f"stream writer {self.dir} failed to publish a segment") from self._error

    def _seal_locked(self) -> None:
        """Caller holds the lock. Hands the buffer to the background thread once the previous sealed
        segment is published (the caller waits for that)."""
        self._cond.wait_for(lambda: not self._sealed or self._error is not None)
        self._check_usable()
        self._totals = self._totals.plus(self._batches)
        self._sealed.append((self._seq, self._batches, self._totals))
        self._seq += 1
        self._batches, self._rows, self._bytes, self._oldest = [], 0, 0, None
        self._cond.notify_all()

    def _due_in(self) -> float:
        """Seconds until the buffered groups must be sealed (the full period when empty)."""
        if self._oldest is None:
            return self.cfg.segment_max_seconds
        return self._oldest + self.cfg.segment_max_seconds - time.monotonic()

    def _publish_in_background(self) -> None:
        """Publish sealed segments in order until closed; the first failure stops it (see the class)."""
        while (job := self._next_sealed()) is not None:
            seq, batches, totals = job
            try:
                publish(self.dir, seq, batches, totals, self.cfg.fsync)  # the lock is free: writes go on meanwhile
            except Exception as err:
                log.exception("stream writer %s: publishing segment %d failed", self.dir, seq)
                with self._cond:
                    self._error = err  # the segment stays sealed: nothing is lost silently
                    self._cond.notify_all()
                return
            with self._cond:
                self._sealed.popleft()
                self.segments_published += 1
                self._cond.notify_all()

    def _next_sealed(self) -> tuple[int, list[pa.RecordBatch], WriterTotals] | None:
        """The oldest sealed segment, once there is one (sealing the buffer when it is due); None once
        the writer is closed and everything sealed is published."""
        with self._cond:
            while not self._sealed:
                if self._stop:
                    return None
                if self._batches and self._due_in() <= 0:
                    self._seal_locked()  # nothing sealed: it does not wait
                else:
                    self._cond.wait(max(0.005, self._due_in()) if self._batches else None)
            return self._sealed[0]
