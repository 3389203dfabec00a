"""StreamWriter: one per actor process; buffers whole groups and publishes them as segments."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from pipelinerl.config import StreamsConfig
from pipelinerl.streams.schema import Rollout, group_batch
from pipelinerl.streams.segments import (
    check_name,
    highest_seq,
    publish,
    temp_files,
    topic_dir,
)

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations are not evaluated at runtime

log = logging.getLogger(__name__)

Row = Rollout | Mapping[str, Any]


class StreamWriter:
    """Appends rollout groups to RUN_DIR/streams/<topic>/<writer_id>/.

    A segment is published when it reaches `segment_max_rows` rows or `segment_max_bytes` bytes, or
    when its oldest group has waited `segment_max_seconds` (a background thread checks this, so an
    actor idling in the lag throttle cannot hold back the samples the trainer needs to advance).
    A group always lands in one segment; a single group larger than the limits makes one large segment.
    `writer_id` must be unique among live writers; a restarted writer with the same id continues the
    sequence numbers and deletes the temporary file its dead predecessor left behind.
    """

    def __init__(self, run_dir: str | os.PathLike, topic: str, writer_id: str, cfg: StreamsConfig):
        self.cfg = cfg
        self.dir = topic_dir(run_dir, topic) / check_name("writer_id", writer_id)
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in temp_files(self.dir):  # unpublished data of a killed predecessor: never visible
            log.warning("removing unpublished temporary segment %s left by a previous writer", stale)
            stale.unlink(missing_ok=True)
        self._seq = highest_seq(self.dir) + 1
        self._batches: list[pa.RecordBatch] = []
        self._rows = 0
        self._bytes = 0
        self._oldest: float | None = None  # monotonic time the oldest buffered group arrived
        self._lock = threading.Lock()
        self._error: BaseException | None = None  # a failed background publish, re-raised on write
        self._closed = False
        self.segments_published = 0
        self.rows_published = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._timer = threading.Thread(target=self._publish_when_due, name=f"stream-writer-{writer_id}",
                                       daemon=True)
        self._timer.start()

    def write(self, row: Row) -> None:
        """One sample as a group of its own (prefer `write_group`: the trainer needs whole groups)."""
        self.write_group([row])

    def write_group(self, rows: Sequence[Row]) -> None:
        """Validate and buffer the G attempts of one prompt. A bad row raises ValueError and the group
        is refused whole; what was buffered before stays."""
        batch = group_batch(rows)  # outside the lock: conversion is the costly part
        with self._lock:
            self._check_usable()
            limit = self.cfg
            if self._batches and (self._rows + batch.num_rows > limit.segment_max_rows
                                  or self._bytes + batch.nbytes > limit.segment_max_bytes):
                self._publish_locked()
            self._batches.append(batch)
            self._rows += batch.num_rows
            self._bytes += batch.nbytes
            if self._oldest is None:
                self._oldest = time.monotonic()
                self._wake.set()  # the timer thread now has a deadline to keep
            if self._rows >= limit.segment_max_rows or self._bytes >= limit.segment_max_bytes:
                self._publish_locked()

    def flush(self) -> None:
        """Publish what is buffered now."""
        with self._lock:
            self._check_usable()
            if self._batches:
                self._publish_locked()

    def close(self) -> None:
        """Publish what is buffered and stop the background thread."""
        if self._closed:
            return
        self._stop.set()
        self._wake.set()
        self._timer.join()
        self.flush()
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

    def _publish_locked(self) -> None:
        """Caller holds the lock. On failure the buffer is kept, so nothing is lost silently."""
        publish(self.dir, self._seq, self._batches, self.cfg.fsync)
        self._seq += 1
        self.segments_published += 1
        self.rows_published += self._rows
        self._batches, self._rows, self._bytes, self._oldest = [], 0, 0, None

    def _due_in(self) -> float:
        """Seconds until the buffered groups must be published (the full period when empty)."""
        if self._oldest is None:
            return self.cfg.segment_max_seconds
        return self._oldest + self.cfg.segment_max_seconds - time.monotonic()

    def _publish_when_due(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(max(0.005, self._due_in()))
            self._wake.clear()
            with self._lock:
                if not self._batches or self._due_in() > 0 or self._error is not None:
                    continue
                try:
                    self._publish_locked()
                except Exception as err:
                    log.exception("stream writer %s: background publish failed", self.dir)
                    self._error = err
