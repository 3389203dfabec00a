"""StreamReader (follow all writers of a topic, dedup, shard, cursor) and `release` (retention)."""

from __future__ import annotations

import logging
import os
import time
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from pipelinerl.config import StreamsConfig
from pipelinerl.streams.segments import (
    CorruptSegment,
    Segment,
    highest_seq,
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


def _check_shard(shard: tuple[int, int] | None) -> tuple[int, int] | None:
    if shard is None:
        return None
    rank, world = shard
    if not (isinstance(rank, int) and isinstance(world, int) and 0 <= rank < world):
        raise ValueError(f"shard must be (rank, world) with 0 <= rank < world, got {shard!r}")
    return rank, world


def _check_cursor(cursor: dict, topic: str) -> dict[str, tuple[int, int]]:
    if not isinstance(cursor, dict) or cursor.get("format") != CURSOR_FORMAT:
        raise ValueError(f"not a stream cursor of format {CURSOR_FORMAT}: {cursor!r}")
    if cursor["topic"] != topic:
        raise ValueError(f"cursor is for topic {cursor['topic']!r}, not {topic!r}")
    return {w: (int(seq), int(group)) for w, (seq, group) in cursor["next"].items()}


class StreamReader:
    """Reads whole groups from every writer of a topic; see the package docstring for the order,
    sharding, dedup and cursor semantics."""

    def __init__(self, run_dir: str | os.PathLike, topic: str, cfg: StreamsConfig,
                 cursor: dict | None = None, shard: tuple[int, int] | None = None):
        self.cfg = cfg
        self.topic = topic
        self.dir = topic_dir(run_dir, topic)
        self.shard = _check_shard(tuple(shard) if shard is not None else None)
        self._next: dict[str, tuple[int, int]] = {}  # per writer: (seq, group) of the next unread group
        if cursor is not None:
            self._next = _check_cursor(cursor, topic)
            saved = tuple(cursor["shard"]) if cursor.get("shard") is not None else None
            if saved != self.shard:
                raise ValueError(f"cursor was saved by shard {saved} but this reader is shard {self.shard}: "
                                 "resume with the same (rank, world)")
        self._queued: dict[str, int] = {w: seq - 1 for w, (seq, _) in self._next.items()}
        self._segments: deque[Segment] = deque()  # listed, not loaded yet
        self._pending: deque[_Item] = deque()  # loaded, not handed out yet
        self._seen = _SeenIds(cfg.dedup_window)
        self.duplicates_dropped = 0
        self.corrupt_segments = 0

    def cursor(self) -> dict[str, Any]:
        """JSON-serialisable position after the last group handed out; save it with the checkpoint."""
        return {"format": CURSOR_FORMAT, "topic": self.topic,
                "shard": list(self.shard) if self.shard else None,
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
                                    f"(shard {self.shard}; writers seen: {sorted(self._queued) or 'none'})")
            time.sleep(min(self.cfg.poll_interval_s, remaining))

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
            if self._is_mine(segment, index) and batch.num_rows:
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
        """Every group is seen by every rank (sharding happens after this), so within one writer all
        ranks make the same decisions."""
        keep = [self._seen.add(sid) for sid in batch.column("sample_id").to_pylist()]
        if all(keep):
            return batch
        self.duplicates_dropped += keep.count(False)
        log.warning("dropped %d duplicate sample id(s) in group %s", keep.count(False),
                    batch.column("group_id")[0].as_py())
        return batch.filter(pa.array(keep))

    def _is_mine(self, segment: Segment, index: int) -> bool:
        """Group `index` of a segment goes to rank (index + seq + hash(writer)) % world: a fixed
        function of the segment, so shares are disjoint and complete whatever each rank saw when;
        consecutive groups and segments rotate over the ranks, so shares stay within one group per
        segment of each other."""
        if self.shard is None:
            return True
        rank, world = self.shard
        return (index + segment.seq + zlib.crc32(segment.writer_id.encode())) % world == rank


def release(run_dir: str | os.PathLike, topic: str, cursors: list[dict], cfg: StreamsConfig) -> list[str]:
    """Retention: with `retention: delete`, delete the segments every given cursor has passed.

    Call it after the checkpoint holding these cursors is written, with the cursors of all ranks
    (a segment one rank has finished may still hold another rank's groups). The newest file of each
    writer is kept: it marks the highest sequence number, so a restarted writer never reuses one that a
    cursor has passed. Returns the deleted paths. With `retention: keep` it deletes nothing.
    """
    if cfg.retention == "keep":
        return []
    positions = [_check_cursor(c, topic) for c in cursors]
    _check_complete_shards(cursors)
    deleted = []
    tdir = topic_dir(run_dir, topic)
    for writer_id in list_writers(tdir):
        bound = min((pos.get(writer_id, (0, 0))[0] for pos in positions), default=0)
        newest = highest_seq(tdir / writer_id)
        for segment in list_segments(tdir / writer_id):
            if segment.seq < bound and segment.seq != newest:
                segment.path.unlink(missing_ok=True)
                deleted.append(str(segment.path))
    log.info("stream %s: released %d consumed segment(s)", tdir, len(deleted))
    return deleted


def _check_complete_shards(cursors: list[dict]) -> None:
    shards = sorted(tuple(c["shard"]) if c.get("shard") else (0, 1) for c in cursors)
    world = shards[0][1] if shards else 1
    if shards != [(r, world) for r in range(world)]:
        raise ValueError(f"release needs the cursors of all {world} rank(s), exactly once each; got "
                         f"shards {shards}")

