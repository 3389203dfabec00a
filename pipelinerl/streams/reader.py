"""StreamReader (follow all writers of a topic, dedup, cursor) and `release` (retention)."""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa

from pipelinerl import atomic
from pipelinerl.config import StreamsConfig
from pipelinerl.streams.segments import (
    CorruptSegment,
    Segment,
    WriterTotals,
    list_segments,
    list_writers,
    load_segment,
    quarantine,
    quarantined_seqs,
    topic_dir,
)

log = logging.getLogger(__name__)

CURSOR_FORMAT = 1  # "groups_before" came later within format 1: a cursor without it means "unknown"
RELEASED_FILE = ".released.json"  # in the topic folder: the furthest cursor `release` deleted behind, per writer


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


class _Position(NamedTuple):
    """Where one writer's stream stands: the next group is group `group` of segment `seq` (or, if that
    number was never published, the first group of the next segment); `before` of this writer's groups
    precede that segment (None: unknown, the next segment is taken as it comes)."""

    seq: int
    group: int
    before: int | None


_Loaded = tuple[list[pa.RecordBatch], WriterTotals | None]  # a segment's groups and its writer's totals
_START = _Position(0, 0, 0)  # a writer this reader has no position for: nothing of it was read or released


@dataclass
class _Item:
    """A group ready to hand out, or (batch None) a marker that only moves the cursor."""

    batch: pa.RecordBatch | None
    writer_id: str
    after: _Position  # the writer's cursor once this item is handed out


def _cursor_json(topic: str, positions: dict[str, _Position]) -> dict[str, Any]:
    return {"format": CURSOR_FORMAT, "topic": topic,
            "next": {w: [p.seq, p.group] for w, p in sorted(positions.items())},
            "groups_before": {w: p.before for w, p in sorted(positions.items()) if p.before is not None}}


def _check_cursor(cursor: dict, topic: str) -> dict[str, _Position]:
    if not isinstance(cursor, dict) or cursor.get("format") != CURSOR_FORMAT:
        raise ValueError(f"not a stream cursor of format {CURSOR_FORMAT}: {cursor!r}")
    if cursor["topic"] != topic:
        raise ValueError(f"cursor is for topic {cursor['topic']!r}, not {topic!r}")
    before = cursor.get("groups_before", {})  # absent in cursors saved before it existed: unknown
    return {w: _Position(int(seq), int(group), None if before.get(w) is None else int(before[w]))
            for w, (seq, group) in cursor["next"].items()}


def _released(tdir: Path, topic: str) -> dict[str, _Position]:
    """Per writer, the position behind which `release` may have deleted segments ({} if it never did)."""
    try:
        return _check_cursor(json.loads((tdir / RELEASED_FILE).read_text()), topic)
    except FileNotFoundError:
        return {}


class StreamReader:
    """Reads whole groups from every writer of a topic; see the package docstring for the order,
    dedup and cursor semantics."""

    def __init__(self, run_dir: str | os.PathLike, topic: str, cfg: StreamsConfig, cursor: dict | None = None):
        self.cfg = cfg
        self.topic = topic
        self.dir = topic_dir(run_dir, topic)
        self._next: dict[str, _Position] = {}  # per writer: the next group to hand out
        if cursor is not None:
            self._next = _check_cursor(cursor, topic)
        self._loaded = dict(self._next)  # per writer: the next group to load
        self._queued: dict[str, int] = {w: p.seq - 1 for w, p in self._next.items()}  # highest seq listed
        self._segments: deque[Segment] = deque()  # listed, not loaded yet
        self._pending: deque[_Item] = deque()  # loaded, not handed out yet
        self._held: dict[str, tuple[Segment, _Loaded]] = {}  # per writer: a segment that waits for an earlier one
        self._seen = _SeenIds(cfg.dedup_window)
        self.duplicates_dropped = 0
        self.corrupt_segments = 0

    def cursor(self) -> dict[str, Any]:
        """JSON-serialisable position after the last group handed out; save it with the checkpoint."""
        return _cursor_json(self.topic, self._next)

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
                waiting = f"; waiting for a late-listed segment of writer(s) {sorted(self._held)}" if self._held else ""
                raise StreamTimeout(f"no rollout group arrived in {self.dir} within {timeout_s:.1f} s "
                                    f"(writers seen: {self.writers_seen() or 'none'}{waiting})")
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
        """Load one more segment into the pending queue; False when none is ready: nothing new is listed, or
        the one loaded must wait for an earlier segment of its writer that the listing does not show yet."""
        if not self._segments:
            self._list_new_segments()
        if not self._segments:
            return False
        segment = self._segments.popleft()
        w = segment.writer_id
        held = self._held.get(w)
        loaded = held[1] if held is not None and held[0] == segment else self._load_or_skip(segment)
        if loaded is None:  # quarantined or vanished: its groups are lost (logged); take the next as it comes
            self._advance(w, _Position(segment.seq + 1, 0, None))
            return True
        batches, totals = loaded
        start = self._start_of(segment, None if totals is None else totals.groups - len(batches))
        if start is None:
            self._wait_for_earlier(segment, loaded, held)
            return bool(self._segments)
        if held is not None and held[0] == segment:
            del self._held[w]
            log.info("stream writer %s: the gap before segment %s is closed; reading on", w, segment.path.name)
        if segment.seq < start.seq:  # behind a released position (see _start_of): consumed already
            return True
        self._hand_out(segment, batches, totals, start)
        return True

    def _start_of(self, segment: Segment, before: int | None) -> _Position | None:
        """The position `segment` is read from (after moving its writer on to a released position that
        explains a gap); None while a published segment of its writer before it is not listed: more of the
        writer's groups precede it (its totals) than this reader has loaded."""
        w = segment.writer_id
        expected = self._loaded.get(w, _START)
        if segment.seq < expected.seq or before is None or expected.before is None or before == expected.before:
            return expected
        if before < expected.before:  # a writer's totals never shrink: duplicates are dropped by sample id
            log.error("stream segment %s: %d of writer %s's groups precede it, but %d were read before it",
                      segment.path, before, w, expected.before)
            return expected
        if any(expected.seq <= q < segment.seq for q in quarantined_seqs(self.dir / w)):
            return expected._replace(before=None)  # quarantined in between: lost, and logged by the quarantine
        released = _released(self.dir, self.topic).get(w)
        if released is not None and released.seq > expected.seq:  # deleted by retention: read on from there
            log.warning("stream writer %s: segments before seq %d were released (retention) before this reader "
                        "read them; it reads on from %s", w, released.seq, released)
            self._advance(w, released)
            self._queued[w] = max(self._queued.get(w, -1), released.seq - 1)
            return self._start_of(segment, before)
        return None

    def _wait_for_earlier(self, segment: Segment, loaded: _Loaded, held: tuple[Segment, _Loaded] | None) -> None:
        """Keep `segment` loaded, drop its writer's later segments from the queue and list them again from
        the writer's position at the next poll (other writers are read meanwhile)."""
        w = segment.writer_id
        if held is None or held[0] != segment:
            batches, totals = loaded
            log.warning("stream writer %s: %d of its groups precede segment %s but this reader has read %d: "
                        "an earlier published segment is not listed yet (a network filesystem's late listing); "
                        "waiting for it", w, totals.groups - len(batches), segment.path,
                        self._loaded.get(w, _START).before)
        self._held[w] = (segment, loaded)
        self._segments = deque(s for s in self._segments if s.writer_id != w)
        self._queued[w] = self._loaded.get(w, _START).seq - 1

    def _hand_out(self, segment: Segment, batches: list[pa.RecordBatch], totals: WriterTotals | None,
                  start: _Position) -> None:
        """Queue the segment's groups from `start` on, then a marker that moves the cursor past it."""
        before = None if totals is None else totals.groups - len(batches)
        first = start.group if start.seq == segment.seq else 0
        for index in range(first, len(batches)):
            batch = self._drop_duplicates(batches[index])
            if batch.num_rows:
                self._pending.append(_Item(batch, segment.writer_id, _Position(segment.seq, index + 1, before)))
        self._advance(segment.writer_id, _Position(segment.seq + 1, 0, None if totals is None else totals.groups))

    def _advance(self, writer_id: str, position: _Position) -> None:
        """The writer's next segment to load is at `position`; the cursor follows once the groups queued
        before it are handed out."""
        self._loaded[writer_id] = position
        self._pending.append(_Item(None, writer_id, position))

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

    def _load_or_skip(self, segment: Segment) -> _Loaded | None:
        """The segment's groups and totals; None if it is damaged (then quarantined) or vanished."""
        try:
            return load_segment(segment)
        except CorruptSegment as err:
            self.corrupt_segments += 1
            quarantine(segment, str(err))
        except FileNotFoundError:
            log.warning("stream segment %s vanished before it was read (moved aside by another reader, "
                        "or released): skipped", segment.path)
        return None

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
    Before it deletes, it records the cursor (per writer, the furthest one released so far) in the topic's
    RELEASED_FILE: a reader that finds a writer's segments missing behind that position (a fresh reader of
    a released stream) reads on from it instead of waiting for them.
    Returns the deleted paths. With `retention: keep` it deletes nothing.
    """
    if cfg.retention == "keep":
        return []
    position = _check_cursor(cursor, topic)
    tdir = topic_dir(run_dir, topic)
    doomed = [segment for writer_id in list_writers(tdir)
              for segment in list_segments(tdir / writer_id)[:-1]
              if segment.seq < position.get(writer_id, _START).seq]
    if doomed:
        released = _released(tdir, topic)
        released.update({w: p for w, p in position.items() if p[:2] >= released.get(w, _START)[:2]})
        atomic.write_file(tdir / RELEASED_FILE, json.dumps(_cursor_json(topic, released)) + "\n", fsync=cfg.fsync)
    for segment in doomed:
        segment.path.unlink(missing_ok=True)
    log.info("stream %s: released %d consumed segment(s)", tdir, len(doomed))
    return [str(segment.path) for segment in doomed]
