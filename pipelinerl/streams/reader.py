"""StreamReader (follow all writers of a topic, dedup, cursor) and `release` (retention)."""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from pipelinerl.config import StreamsConfig
from pipelinerl.streams.segments import (
    CorruptSegment,
    Segment,
    list_segments,
    list_writers,
    load_segment,
    quarantine,
    topic_dir,
)

log = logging.getLogger(__name__)

CURSOR_FORMAT = 1


class StreamTimeout(TimeoutError):
    """No group arrived before the deadline; the message names the folder that was polled."""


class _SeenIds:
    """Sample ids already read, bounded: the oldest id is forgotten once `capacity` are held
    (None = unbounded). A duplicate further back than `capacity` samples is not detected."""

    def __init__(self, capacity: int | None):
        self.capacity = capacity
        self._ids: set[str] = set()
        self._order: deque[str] = deque()

    def add(self, sample_id: str) -> bool:
        """True if the id is new (and remember it), False for a duplicate."""
        if sample_id in self._ids:
            return False
        self._ids.add(sample_id)
        self._order.append(sample_id)
        if self.capacity is not None and len(self._order) > self.capacity:
            self._ids.discard(self._order.popleft())
        return True


@dataclass
class _Item:
    """A group ready to hand out, or (batch None) a marker that only moves the cursor."""

    batch: pa.RecordBatch | None
    writer_id: str
    after: tuple[int, int]  # the writer's cursor once this item is handed out: (seq, next group index)


def _check_cursor(cursor: dict, topic: str) -> dict[str, tuple[int, int]]:
    if not isinstance(cursor, dict) or cursor.get("format") != CURSOR_FORMAT:
        raise ValueError(f"not a stream cursor of format {CURSOR_FORMAT}: {cursor!r}")
    if cursor["topic"] != topic:
        raise ValueError(f"cursor is for topic {cursor['topic']!r}, not {topic!r}")
    return {w: (int(seq), int(group)) for w, (seq, group) in cursor["next"].items()}


class StreamReader:
    """Reads whole groups from every writer of a topic; see the package docstring for the order,
    dedup and cursor semantics."""

    def __init__(self, run_dir: str | os.PathLike, topic: str, cfg: StreamsConfig, cursor: dict | None = None):
        self.cfg = cfg
        self.topic = topic
        self.dir = topic_dir(run_dir, topic)
        self._next: dict[str, tuple[int, int]] = {}  # per writer: (seq, group) of the next unread group
        if cursor is not None:
            self._next = _check_cursor(cursor, topic)
        self._queued: dict[str, int] = {w: seq - 1 for w, (seq, _) in self._next.items()}
        self._segments: deque[Segment] = deque()  # listed, not loaded yet
        self._pending: deque[_Item] = deque()  # loaded, not handed out yet
        self._seen = _SeenIds(cfg.dedup_window)
        self.duplicates_dropped = 0
        self.corrupt_segments = 0

    def cursor(self) -> dict[str, Any]:
        """JSON-serialisable position after the last group handed out; save it with the checkpoint."""
        return {"format": CURSOR_FORMAT, "topic": self.topic,
                "next": {w: list(pos) for w, pos in sorted(self._next.items())}}

    def read_groups(self, max_groups: int, timeout_s: float) -> list[pa.RecordBatch]:
        """Up to `max_groups` groups (one record batch of ROLLOUT_SCHEMA rows each), waiting at most
        `timeout_s` for that many. At the deadline it returns what it has; StreamTimeout if nothing."""
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups}")
        deadline = time.monotonic() + timeout_s
        out: list[pa.RecordBatch] = []
        while True:
            out += self._take(max_groups - len(out))
            if len(out) >= max_groups:
                return out
            if self._load_next():
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if out:
                    return out
                raise StreamTimeout(f"no rollout group arrived in {self.dir} within {timeout_s:.1f} s "
                                    f"(writers seen: {self.writers_seen() or 'none'})")
            time.sleep(min(self.cfg.poll_interval_s, remaining))

    def writers_seen(self) -> list[str]:
        return sorted(self._queued)

    def _take(self, n: int) -> list[pa.RecordBatch]:
        out = []
        while self._pending and (len(out) < n or self._pending[0].batch is None):
            item = self._pending.popleft()
            self._next[item.writer_id] = item.after
            if item.batch is not None:
                out.append(item.batch)
        return out

    def _load_next(self) -> bool:
        """Load one more segment into the pending queue; False when no new segment is visible."""
        if not self._segments:
            self._list_new_segments()
        if not self._segments:
            return False
        segment = self._segments.popleft()
        batches = self._load_or_skip(segment)
        start = self._next.get(segment.writer_id, (0, 0))
        first = start[1] if start[0] == segment.seq else 0
        for index in range(first, len(batches)):
            batch = self._drop_duplicates(batches[index])
            if batch.num_rows:
                self._pending.append(_Item(batch, segment.writer_id, (segment.seq, index + 1)))
        self._pending.append(_Item(None, segment.writer_id, (segment.seq + 1, 0)))
        return True

    def _list_new_segments(self) -> None:
        """Queue the segments published since the last listing, interleaving writers round-robin so
        that one writer's backlog does not starve the others."""
        per_writer = []
        for writer_id in list_writers(self.dir):
            after = self._queued.get(writer_id, -1)
            fresh = [s for s in list_segments(self.dir / writer_id) if s.seq > after]
            if fresh:
                self._queued[writer_id] = fresh[-1].seq
                per_writer.append(fresh)
            else:
                self._queued.setdefault(writer_id, after)
        for rank in range(max(map(len, per_writer), default=0)):
            self._segments.extend(fresh[rank] for fresh in per_writer if rank < len(fresh))

    def _load_or_skip(self, segment: Segment) -> list[pa.RecordBatch]:
        try:
            return load_segment(segment)
        except CorruptSegment as err:
            self.corrupt_segments += 1
            quarantine(segment, str(err))
        except FileNotFoundError:
            log.warning("stream segment %s vanished before it was read (moved aside by another reader, "
                        "or released): skipped", segment.path)
        return []

    def _drop_duplicates(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        keep = [self._seen.add(sid) for sid in batch.column("sample_id").to_pylist()]
        if all(keep):
            return batch
        self.duplicates_dropped += keep.count(False)
        log.warning("dropped %d duplicate sample id(s) in group %s", keep.count(False),
                    batch.column("group_id")[0].as_py())
        return batch.filter(pa.array(keep))


def release(run_dir: str | os.PathLike, topic: str, cursor: dict, cfg: StreamsConfig) -> list[str]:
    """Retention: with `retention: delete`, delete the segments the given cursor has passed.

    Call it after the checkpoint holding this cursor is written. The newest published segment of each
    writer is kept: it holds the writer's totals (segments.WriterTotals) and the highest sequence number a
    cursor can have passed, so a restarted writer (and its actor) counts on from it and never reuses a
    number. (Not the newest file: that may be a temporary one, which a restarted writer deletes.)
    Returns the deleted paths. With `retention: keep` it deletes nothing.
    """
    if cfg.retention == "keep":
        return []
    position = _check_cursor(cursor, topic)
    deleted = []
    tdir = topic_dir(run_dir, topic)
    for writer_id in list_writers(tdir):
        bound = position.get(writer_id, (0, 0))[0]
        for segment in list_segments(tdir / writer_id)[:-1]:
            if segment.seq < bound:
                segment.path.unlink(missing_ok=True)
                deleted.append(str(segment.path))
    log.info("stream %s: released %d consumed segment(s)", tdir, len(deleted))
    return deleted
