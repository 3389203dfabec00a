"""Rollout streams read through listings that show a segment late (a network filesystem's directory cache):
the reader waits for the missing segment instead of skipping it, and is not held up by the gaps that are
legitimate (a number never published, a quarantined segment, released segments).

A late listing is simulated deterministically: a published segment is moved out of its writer's folder
("hidden") and later moved back; between, every listing misses it while it shows the segments after it.
"""

import json
import logging
from pathlib import Path

import pytest
from test_streams import TOPIC, check_group, expected_group, ids_of, read_all, write_groups

import pipelinerl.streams.reader as reader_module
import pipelinerl.streams.writer as writer_module
from pipelinerl.config import StreamsConfig
from pipelinerl.streams import StreamReader, StreamTimeout, release
from pipelinerl.streams.segments import Segment, list_segments


def _cfg(**kw) -> StreamsConfig:
    return StreamsConfig(**{"segment_max_rows": 8, "segment_max_seconds": 60.0, "poll_interval_s": 0.02, **kw})


def _wdir(run_dir: Path, writer: str) -> Path:
    return run_dir / "streams" / TOPIC / writer


def _hide(run_dir: Path, writer: str, seq: int) -> tuple[Path, Path]:
    """Move segment `seq` out of its folder (no listing shows it); returns (where it was, where it is)."""
    segment = next(s for s in list_segments(_wdir(run_dir, writer)) if s.seq == seq)
    aside = run_dir / "aside" / segment.path.name
    aside.parent.mkdir(exist_ok=True)
    segment.path.rename(aside)
    return segment.path, aside


def _unhide(hidden: tuple[Path, Path]) -> None:
    original, aside = hidden
    aside.rename(original)


def _ids(writer: str, groups) -> list[str]:
    return [r["sample_id"] for g in groups for r in expected_group(writer, g)]


def _read_until_idle(reader: StreamReader) -> list:
    """Everything the reader hands out now (a 0.2 s read: ten polls at _cfg's interval)."""
    return read_all(reader, timeout_s=0.2)


def test_a_segment_listed_late_is_waited_for_then_read_in_order_exactly_once(tmp_path, caplog):
    write_groups(tmp_path, "a", range(6), _cfg())  # segments 0, 1, 2 of two groups each
    write_groups(tmp_path, "b", range(4), _cfg())  # another writer, read meanwhile
    hidden = _hide(tmp_path, "a", 1)
    reader = StreamReader(tmp_path, TOPIC, _cfg())
    with caplog.at_level(logging.WARNING):
        first = _read_until_idle(reader)
        assert reader.cursor()["next"]["a"] == [1, 0] and reader.cursor()["groups_before"]["a"] == 2
        with pytest.raises(StreamTimeout, match=r"waiting for a late-listed segment of writer\(s\) \['a'\]"):
            reader.read_groups(1, timeout_s=0.2)  # more polls: still waiting, not skipping
    assert sorted(ids_of(first)) == sorted(_ids("a", range(2)) + _ids("b", range(4)))
    warnings = [r.getMessage() for r in caplog.records if "not listed yet" in r.getMessage()]
    assert len(warnings) == 1  # once per gap, however many polls
    assert "stream writer a: 4 of its groups precede segment" in warnings[0] and "has read 2" in warnings[0]
    assert "00000002." in warnings[0]
    _unhide(hidden)
    rest = _read_until_idle(reader)
    assert ids_of(rest) == _ids("a", range(2, 6))  # segment 1 then segment 2
    for batch in first + rest:
        check_group(batch)
    assert reader.cursor()["next"]["a"] == [3, 0] and reader.cursor()["groups_before"] == {"a": 6, "b": 4}


def test_resume_from_a_cursor_saved_while_waiting_neither_skips_nor_repeats(tmp_path):
    write_groups(tmp_path, "a", range(8), _cfg(), flush_every=2)  # segments 0..3
    hidden = _hide(tmp_path, "a", 2)
    reader = StreamReader(tmp_path, TOPIC, _cfg())
    trained = ids_of(_read_until_idle(reader))
    assert trained == _ids("a", range(4))
    cursor = json.loads(json.dumps(reader.cursor()))  # as the checkpoint saves it
    resumed = StreamReader(tmp_path, TOPIC, _cfg(), cursor=cursor)
    assert _read_until_idle(resumed) == []  # still hidden: the resumed reader waits too
    _unhide(hidden)
    trained += ids_of(_read_until_idle(StreamReader(tmp_path, TOPIC, _cfg(), cursor=cursor)))
    assert trained == _ids("a", range(8))


def test_a_hidden_first_segment_holds_back_a_fresh_reader(tmp_path):
    write_groups(tmp_path, "a", range(4), _cfg())
    hidden = _hide(tmp_path, "a", 0)
    reader = StreamReader(tmp_path, TOPIC, _cfg())
    assert _read_until_idle(reader) == []
    _unhide(hidden)
    assert ids_of(_read_until_idle(reader)) == _ids("a", range(4))


def test_a_number_never_published_is_no_gap(tmp_path, monkeypatch, caplog):
    """A killed writer's temporary file that stays (here: its successor does not see it to delete it) makes
    the successor continue after its number; the totals run on, so the reader does not wait."""
    write_groups(tmp_path, "a", range(4), _cfg(), flush_every=2)  # segments 0, 1
    (_wdir(tmp_path, "a") / ".00000002.tmp").write_bytes(b"half a segment")
    monkeypatch.setattr(writer_module, "temp_files", lambda wdir: [])
    write_groups(tmp_path, "a", range(4, 6), _cfg())
    assert [s.seq for s in list_segments(_wdir(tmp_path, "a"))] == [0, 1, 3]
    with caplog.at_level(logging.WARNING):
        assert ids_of(StreamReader(tmp_path, TOPIC, _cfg()).read_groups(6, timeout_s=5.0)) == _ids("a", range(6))
    assert "not listed yet" not in caplog.text


def test_a_segment_quarantined_by_another_reader_is_no_gap(tmp_path):
    write_groups(tmp_path, "a", range(6), _cfg())  # segments 0, 1, 2
    segment = list_segments(_wdir(tmp_path, "a"))[1]
    segment.path.rename(segment.path.with_name(segment.path.name + ".corrupt"))  # as quarantine() names it
    groups = StreamReader(tmp_path, TOPIC, _cfg()).read_groups(4, timeout_s=5.0)
    assert ids_of(groups) == _ids("a", [0, 1, 4, 5])


def test_a_segment_this_reader_quarantines_or_sees_vanish_is_no_gap(tmp_path, monkeypatch):
    write_groups(tmp_path, "a", range(8), _cfg())  # segments 0..3
    segments = list_segments(_wdir(tmp_path, "a"))
    data = bytearray(segments[1].path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    segments[1].path.write_bytes(bytes(data))
    real_load = reader_module.load_segment

    def vanish_3(segment: Segment):
        if segment.seq == 3:
            raise FileNotFoundError(segment.path)
        return real_load(segment)

    monkeypatch.setattr(reader_module, "load_segment", vanish_3)
    write_groups(tmp_path, "a", range(8, 10), _cfg())  # segment 4, after the vanished one
    reader = StreamReader(tmp_path, TOPIC, _cfg())
    assert ids_of(reader.read_groups(6, timeout_s=5.0)) == _ids("a", [0, 1, 4, 5, 8, 9])
    assert reader.corrupt_segments == 1


def test_a_fresh_reader_of_a_released_stream_reads_on_from_the_release_and_still_waits_for_late_ones(
        tmp_path, caplog):
    write_groups(tmp_path, "a", range(6), _cfg(), flush_every=1)  # segments 0..5, one group each
    trainer = StreamReader(tmp_path, TOPIC, _cfg())
    assert ids_of(trainer.read_groups(3, timeout_s=5.0)) == _ids("a", range(3))
    cursor = trainer.cursor()
    assert cursor["next"]["a"] == [3, 0] and cursor["groups_before"]["a"] == 3
    assert len(release(tmp_path, TOPIC, cursor, _cfg(retention="delete"))) == 3
    hidden = _hide(tmp_path, "a", 4)
    fresh = StreamReader(tmp_path, TOPIC, _cfg())
    with caplog.at_level(logging.WARNING):
        assert ids_of(_read_until_idle(fresh)) == _ids("a", [3])  # not segment 5: 4 is not listed yet
    assert "segments before seq 3 were released" in caplog.text
    _unhide(hidden)
    assert ids_of(_read_until_idle(fresh)) == _ids("a", [4, 5])
    # the trainer itself reads on as if nothing happened; a release with an older cursor moves nothing back
    assert ids_of(_read_until_idle(trainer)) == _ids("a", range(3, 6))
    assert release(tmp_path, TOPIC, {**cursor, "next": {"a": [1, 0]}}, _cfg(retention="delete")) == []
    assert json.loads((tmp_path / "streams" / TOPIC / ".released.json").read_text())["next"] == {"a": [3, 0]}


def test_a_trainer_resumed_behind_the_last_release_reads_on_from_it(tmp_path, caplog):
    write_groups(tmp_path, "a", range(6), _cfg(), flush_every=1)
    reader = StreamReader(tmp_path, TOPIC, _cfg())
    reader.read_groups(2, timeout_s=5.0)
    older = reader.cursor()  # an older checkpoint's cursor
    reader.read_groups(2, timeout_s=5.0)
    release(tmp_path, TOPIC, reader.cursor(), _cfg(retention="delete"))  # the newer checkpoint's
    with caplog.at_level(logging.WARNING):
        got = _read_until_idle(StreamReader(tmp_path, TOPIC, _cfg(), cursor=older))
    assert ids_of(got) == _ids("a", [4, 5]) and "released (retention)" in caplog.text


def test_a_cursor_without_groups_before_still_loads_and_takes_the_next_segment_as_it_comes(tmp_path):
    write_groups(tmp_path, "a", range(6), _cfg())  # segments 0, 1, 2
    old = {"format": 1, "topic": TOPIC, "next": {"a": [1, 1]}}  # saved by a pipelinerl without the field
    reader = StreamReader(tmp_path, TOPIC, _cfg(), cursor=old)
    assert ids_of(_read_until_idle(reader)) == _ids("a", [3, 4, 5])
    assert reader.cursor() == {"format": 1, "topic": TOPIC, "next": {"a": [3, 0]}, "groups_before": {"a": 6}}
    assert release(tmp_path, TOPIC, old, _cfg(retention="delete")) != []  # release reads it too


def test_fewer_groups_before_a_segment_than_read_is_logged_and_read_on(tmp_path, caplog):
    write_groups(tmp_path, "a", range(6), _cfg())
    wrong = {"format": 1, "topic": TOPIC, "next": {"a": [1, 0]}, "groups_before": {"a": 5}}
    with caplog.at_level(logging.ERROR):
        assert ids_of(_read_until_idle(StreamReader(tmp_path, TOPIC, _cfg(), cursor=wrong))) == _ids("a", range(2, 6))
    assert "2 of writer a's groups precede it, but 5 were read before it" in caplog.text
