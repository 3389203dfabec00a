"""Segment files: where they live, how they are named, published, verified and moved aside.

    RUN_DIR/streams/<topic>/<writer_id>/<seq:08d>.<crc32:08x>.arrow    published (Arrow IPC file format)
    RUN_DIR/streams/<topic>/<writer_id>/.<seq:08d>.tmp                 being written (never read)
    RUN_DIR/streams/<topic>/<writer_id>/<seq:08d>.<crc32:08x>.arrow.corrupt   quarantined

Arrow IPC has no checksum, so a flipped byte in a token column would decode silently; the CRC-32 of the
whole file is in its name (it cannot go inside: the schema is written first and the footer must end
the file). Each record batch of a segment is exactly one group.

Each segment's schema metadata also holds its writer's totals through it (`WriterTotals`: groups and rows
published by that writer id in all its lives). The newest published segment of a writer is never released,
so its totals survive retention: they are where a restarted writer, and a restarted actor, count from.
Totals minus the segment's own groups are the groups published before it, which lets a reader tell a
published segment that a listing does not show yet from a number that was never published.
"""

from __future__ import annotations

import json
import logging
import os
import re
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa

from pipelinerl import atomic
from pipelinerl.streams.schema import ROLLOUT_SCHEMA, SCHEMA_VERSION, schema_version_of

log = logging.getLogger(__name__)

_SEGMENT_RE = re.compile(r"^(\d{8,})\.([0-9a-f]{8})\.arrow$")
_ANY_SEQ_RE = re.compile(r"^\.?(\d{8,})\.")  # published, quarantined and temporary names alike
_CORRUPT_RE = re.compile(r"^(\d{8,})\.[0-9a-f]{8}\.arrow\.corrupt$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
CORRUPT_SUFFIX = ".corrupt"
TOTALS_KEY = b"pipelinerl.writer_totals"  # schema metadata: WriterTotals as JSON

ROLLOUT_TOPIC = "rollouts"  # the actors' training samples, read by the trainer (RUN_DIR/streams/rollouts)
FILTERED_TOPIC = "filtered"  # groups of equal rewards the actors did not hand to the trainer (rl.filter_zero_variance)
EVAL_TOPIC = "eval"  # the actors' held-out evaluation completions, for analysis (RUN_DIR/streams/eval)


class CorruptSegment(Exception):
    """A published segment whose bytes do not match its checksum or do not decode."""


@dataclass(frozen=True)
class Segment:
    writer_id: str
    seq: int
    crc: int
    path: Path


@dataclass(frozen=True)
class WriterTotals:
    """What one writer id has published, this segment included, over all its restarts."""

    groups: int = 0
    rows: int = 0

    def plus(self, batches: Sequence[pa.RecordBatch]) -> WriterTotals:
        return WriterTotals(self.groups + len(batches), self.rows + sum(b.num_rows for b in batches))


def check_name(kind: str, name: str) -> str:
    """Topics and writer ids become folder names on a shared filesystem: keep them plain."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"stream {kind} {name!r} must be letters, digits, '_', '-' or '.', "
                         "not starting with '.' or '-'")
    return name


def topic_dir(run_dir: str | os.PathLike, topic: str) -> Path:
    return Path(run_dir) / "streams" / check_name("topic", topic)


def list_writers(tdir: Path) -> list[str]:
    """Writer folders of a topic, sorted (writers that appear later are picked up on the next call)."""
    try:
        return sorted(e.name for e in os.scandir(tdir) if e.is_dir() and _NAME_RE.match(e.name))
    except FileNotFoundError:
        return []


def list_segments(wdir: Path) -> list[Segment]:
    """Published segments of one writer, by sequence number."""
    try:
        names = os.listdir(wdir)
    except FileNotFoundError:
        return []
    segments = []
    for name in names:
        m = _SEGMENT_RE.match(name)
        if m:
            segments.append(Segment(wdir.name, int(m.group(1)), int(m.group(2), 16), wdir / name))
    return sorted(segments, key=lambda s: s.seq)


def quarantined_seqs(wdir: Path) -> list[int]:
    """Sequence numbers of this writer's quarantined (`*.corrupt`) segments, sorted."""
    try:
        names = os.listdir(wdir)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(_CORRUPT_RE.match, names) if m)


def highest_seq(wdir: Path) -> int:
    """The highest sequence number any file of this writer ever used (-1 if none): a restarted writer
    continues after it, so a cursor that is past a number never skips new data."""
    seqs = [int(m.group(1)) for m in map(_ANY_SEQ_RE.match, os.listdir(wdir)) if m]
    return max(seqs, default=-1)


def temp_files(wdir: Path) -> list[Path]:
    return sorted(p for p in wdir.glob(".*.tmp"))


def segment_path(wdir: Path, seq: int, crc: int) -> Path:
    return wdir / f"{seq:08d}.{crc:08x}.arrow"


def _file_crc(path: Path) -> int:
    with pa.memory_map(str(path)) as mapped:  # hashes the page cache in place: no copy
        return zlib.crc32(mapped.read_buffer())


def publish(wdir: Path, seq: int, batches: Sequence[pa.RecordBatch], totals: WriterTotals, fsync: bool) -> Path:
    """Write to a hidden temporary name, fsync, rename into place: readers see all of it or nothing.
    `totals` (through this segment) go into its schema metadata, so they are published with it, atomically.
    Arrow writes the file itself (no intermediate buffer); the CRC is then taken from the page cache."""
    tmp = wdir / f".{seq:08d}.tmp"
    schema = ROLLOUT_SCHEMA.with_metadata({**ROLLOUT_SCHEMA.metadata, TOTALS_KEY: json.dumps(asdict(totals)).encode()})
    # Buffered: a segment is hundreds of small Arrow buffers, one write() syscall each without it.
    with pa.output_stream(str(tmp), buffer_size=2**20) as sink, pa.ipc.new_file(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    final = segment_path(wdir, seq, _file_crc(tmp))
    # rename() silently replaces; an existing name means a second live writer uses this writer_id.
    if final.exists():
        raise RuntimeError(f"segment {final} already exists: two writers share writer_id {wdir.name!r}")
    atomic.publish(tmp, final, fsync)
    return final


def writer_totals(wdir: Path) -> WriterTotals:
    """The totals of a writer's newest published segment that verifies (zeros if none). A damaged newest
    segment is skipped, as the trainer skips it: its groups count as never published."""
    while True:
        try:
            return next(filter(None, map(_verified_totals, reversed(list_segments(wdir)))), WriterTotals())
        except FileNotFoundError:  # released or quarantined since the listing: list again
            continue


def _verified_totals(segment: Segment) -> WriterTotals | None:
    """A segment's totals; None if its bytes do not match its CRC or do not decode."""
    try:
        if _file_crc(segment.path) != segment.crc:
            return None
        with pa.memory_map(str(segment.path)) as mapped:  # reads the footer, not the token data
            metadata = pa.ipc.open_file(mapped).schema.metadata or {}
    except pa.ArrowInvalid:
        return None
    totals = totals_of(metadata)
    if totals is None:
        raise ValueError(f"segment {segment.path} has no writer totals: it was written by an older pipelinerl, "
                         "whose streams a restarted writer cannot continue; start a new run_dir")
    return totals


def totals_of(metadata: dict[bytes, bytes] | None) -> WriterTotals | None:
    """The writer totals in a segment's schema metadata; None in a segment of an older pipelinerl."""
    raw = (metadata or {}).get(TOTALS_KEY)
    return None if raw is None else WriterTotals(**json.loads(raw))


def load_segment(segment: Segment) -> tuple[list[pa.RecordBatch], WriterTotals | None]:
    """The groups of a segment and its writer's totals through it (None if it has none). CorruptSegment if
    damaged; ValueError if written with another rollout schema version (older or newer); FileNotFoundError
    if it vanished (quarantined by another reader, or released)."""
    with pa.OSFile(str(segment.path), "r") as f:  # into Arrow's memory pool: fewer page faults than bytes
        data = f.read()
    if zlib.crc32(data) != segment.crc:
        raise CorruptSegment(f"checksum mismatch ({len(data)} bytes; truncated or overwritten)")
    try:
        reader = pa.ipc.open_file(data)
        schema = reader.schema
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        for batch in batches:
            batch.validate()  # the CRC already vouches for every byte; this checks the structure
    except (pa.ArrowException, OSError) as err:
        raise CorruptSegment(f"does not decode as Arrow IPC: {err}") from None
    version = schema_version_of(schema)
    if version != SCHEMA_VERSION:
        age = "an older" if version < SCHEMA_VERSION else "a newer"
        raise ValueError(f"segment {segment.path} has rollout schema version {version}; this reader expects version "
                         f"{SCHEMA_VERSION} and reads no other: the segment was written by {age} pipelinerl. Run the "
                         "same pipelinerl version on both sides (a stream of another version: start a new run_dir)")
    if not schema.remove_metadata().equals(ROLLOUT_SCHEMA.remove_metadata()):
        raise CorruptSegment(f"schema differs from the rollout schema: {schema}")
    return batches, totals_of(schema.metadata)


def quarantine(segment: Segment, reason: str) -> None:
    """Rename a damaged segment aside so that no reader tries it again, and say so in the log."""
    target = segment.path.with_name(segment.path.name + CORRUPT_SUFFIX)
    try:
        os.rename(segment.path, target)
    except FileNotFoundError:  # another reader (rank) moved it first
        pass
    log.error("stream segment %s is damaged (%s): moved aside to %s and skipped", segment.path, reason,
              target.name)
