"""Rollout streams in one process: schema, validation, rolling, order, faults, cursors,
dedup, retention, timeouts, inspect. The multi-process and SIGKILL tests are in test_streams_processes.py.

Every sample's content is a pure function of its ids (`expected_row`), so a read-back group is checked
field by field, not only counted.
"""

import json
import logging
import os
import random
import re
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from pipelinerl.cli import main as cli_main
from pipelinerl.config import ConfigError, StreamsConfig, load_config
from pipelinerl.streams import (
    SCHEMA_VERSION,
    Rollout,
    StreamReader,
    StreamTimeout,
    StreamWriter,
    inspect,
    release,
)
from pipelinerl.streams.schema import ROLLOUT_SCHEMA, SCHEMA_VERSION_KEY, group_batch
from pipelinerl.streams.segments import WriterTotals, list_segments, load_segment, segment_path, writer_totals

TOPIC = "rollouts"
G = 4


def expected_row(writer: str, group: int, i: int) -> dict:
    """The sample `i` of group `group` of `writer`; float values are exact in float32. In every third group
    the samples of 3 tokens or more are two-turn episodes: model tokens (one version), environment tokens
    (loss mask 0, version -1, log-prob 0), model tokens (the next version). Every fourth group carries a teacher's
    top-2 per token, every fifth routed experts (2 layers x top-2 per token; ids up to 300: uint16)."""
    length = 1 + (group * 7 + i) % 13
    episode = group % 3 == 2 and length >= 3
    mask = [int(not (episode and length // 3 <= k < 2 * length // 3)) for k in range(length)]
    top = group % 4 == 3
    routed = group % 5 == 4
    return {"run_id": "run", "group_id": f"{writer}/g{group}", "sample_id": f"{writer}/g{group}/s{i}",
                "prompt_token_ids": [(group + k) % 997 for k in range(3 + group % 4)],
                "completion_token_ids": [(group * 31 + i * 7 + k) % 151_000 for k in range(length)],
                "behaviour_logprobs": [-(k % 8) / 4 if m else 0.0 for k, m in enumerate(mask)],
                "versions": [group // 3 + (k >= length // 2) if m else -1 for k, m in enumerate(mask)],
                "loss_mask": mask,
                "reference_logprobs": [-(k % 5) / 8 for k in range(length)] if group % 2 else [],
                "teacher_top_ids": [(k * 3 + j) % 15 for k in range(length) for j in range(2)] if top else [],
                "teacher_top_logprobs": [-(k + j) / 4 for k in range(length) for j in range(2)] if top else [],
                "routed_experts": [(k * 7 + j * 150) % 301 for k in range(length) for j in range(4)] if routed else [],
                "reward": float(i == group % G), "finished": i % 2 == 0, "truncated": i % 2 == 1,
                "turns": 1 + episode, "tool_calls": int(episode), "tool_errors": int(episode and i == 3),
                "end_reason": "finished" if i % 2 == 0 else "max_turns" if episode else "truncated", "task": "addition",
                "metadata": json.dumps({"answer": group}), "actor_id": writer, "created_at": 1000.0 + group}


def expected_group(writer: str, group: int, size: int = G) -> list[dict]:
    return [expected_row(writer, group, i) for i in range(size)]


def check_group(batch: pa.RecordBatch) -> None:
    """A read-back group equals what its writer wrote, field by field (written_at aside)."""
    rows = batch.to_pylist()
    writer, group = rows[0]["group_id"].rsplit("/g", 1)
    for row in rows:
        want = expected_row(writer, int(group), int(row["sample_id"].rsplit("/s", 1)[1]))
        assert row.pop("written_at") >= want["created_at"]
        assert row == want


def ids_of(groups: list[pa.RecordBatch]) -> list[str]:
    return [sid for b in groups for sid in b.column("sample_id").to_pylist()]


def read_all(reader: StreamReader, timeout_s: float = 0.05) -> list[pa.RecordBatch]:
    out = []
    while True:
        try:
            out += reader.read_groups(1000, timeout_s)
        except StreamTimeout:
            return out


def write_groups(run_dir, writer: str, groups, cfg: StreamsConfig, flush_every: int = 0) -> None:
    with StreamWriter(run_dir, TOPIC, writer, cfg) as w:
        for n, g in enumerate(groups, 1):
            w.write_group(expected_group(writer, g))
            if flush_every and n % flush_every == 0:
                w.flush()


def cfg_(**kw) -> StreamsConfig:
    base = {"segment_max_rows": 8, "segment_max_seconds": 60.0, "poll_interval_s": 0.02}
    return StreamsConfig(**{**base, **kw})


def test_round_trip_keeps_every_field_for_lists_and_numpy(tmp_path):
    rows = expected_group("w0", 5)
    numpy_rows = [dict(r, completion_token_ids=np.array(r["completion_token_ids"], np.int64),
                       behaviour_logprobs=np.array(r["behaviour_logprobs"]), versions=np.array(r["versions"]),
                       loss_mask=np.array(r["loss_mask"], np.int8))
                  for r in expected_group("w0", 8)]
    dataclass_rows = [Rollout(**r) for r in expected_group("w0", 11)]
    routed_rows = [dict(r, routed_experts=np.array(r["routed_experts"], np.uint16)) for r in expected_group("w0", 14)]
    with StreamWriter(tmp_path, TOPIC, "w0", cfg_()) as w:
        w.write_group(rows)
        w.write_group(numpy_rows)
        w.write_group(dataclass_rows)
        w.write_group(routed_rows)
    groups = read_all(StreamReader(tmp_path, TOPIC, cfg_()))
    assert [b.column("group_id")[0].as_py() for b in groups] == ["w0/g5", "w0/g8", "w0/g11", "w0/g14"]
    assert groups[3].column("routed_experts").flatten().to_pylist()[:6] == [0, 150, 300, 149, 7, 157]
    assert all(0 in b.column("loss_mask").flatten().to_pylist() for b in groups)  # episodes: environment tokens
    for b in groups:
        check_group(b)
        assert b.schema.equals(ROLLOUT_SCHEMA)


def test_reference_logprobs_are_empty_or_one_per_token_and_default_to_empty(tmp_path):
    full = expected_group("w0", 1)  # odd group: one reference log-prob per completion token
    absent = [{k: v for k, v in r.items() if k != "reference_logprobs"} for r in expected_group("w0", 2)]
    with StreamWriter(tmp_path, TOPIC, "w0", cfg_()) as w:
        w.write_group(full)
        w.write_group(absent)
    got = read_all(StreamReader(tmp_path, TOPIC, cfg_()))
    assert [len(r["reference_logprobs"]) for r in got[0].to_pylist()] == [len(r["completion_token_ids"]) for r in full]
    assert [r["reference_logprobs"] for r in got[1].to_pylist()] == [[]] * G
    for b in got:
        check_group(b)


def test_the_teachers_top_k_travel_k_per_token_and_default_to_empty(tmp_path):
    """rl.teacher_top_k: k = 2 ids and log-probs per completion token, flattened; rows without them get []."""
    top = expected_group("w0", 1)
    for r in top:
        n = len(r["completion_token_ids"])
        r["teacher_top_ids"] = [(t * 2 + j) % 15 for t in range(n) for j in range(2)]
        r["teacher_top_logprobs"] = [-(t + j) / 4 for t in range(n) for j in range(2)]
    with StreamWriter(tmp_path, TOPIC, "w0", cfg_()) as w:
        w.write_group(top)
        w.write_group(expected_group("w0", 2))
    got = read_all(StreamReader(tmp_path, TOPIC, cfg_()))
    for row, want in zip(got[0].to_pylist(), top, strict=True):
        assert (row["teacher_top_ids"], row["teacher_top_logprobs"]) == (want["teacher_top_ids"],
                                                                          want["teacher_top_logprobs"])
    assert [(r["teacher_top_ids"], r["teacher_top_logprobs"]) for r in got[1].to_pylist()] == [([], [])] * G


def _mutate(key, value):
    """Set a field of the second row; `value` may be a function of the field's old value."""
    return lambda rows: rows[1].__setitem__(key, value(rows[1][key]) if callable(value) else value)


BAD_ROWS = [
    (_mutate("behaviour_logprobs", [-0.5]), "`behaviour_logprobs` has 1 entries"),
    (_mutate("versions", []), "`versions` has 0 entries"),
    (_mutate("completion_token_ids", lambda v: [t + 0.5 for t in v]), "must hold integers"),
    (_mutate("prompt_token_ids", [2**40]), "does not fit int32"),
    (_mutate("reward", float("nan")), "`reward` must be a number"),
    (_mutate("behaviour_logprobs", lambda v: [float("nan")] * len(v)), "contains NaN"),
    (_mutate("reference_logprobs", [-0.5]), "`reference_logprobs` has 1 entries but the completion has 9 tokens"),
    (_mutate("reference_logprobs", lambda v: [float("nan")] * len(v)), "`reference_logprobs` contains NaN"),
    (_mutate("teacher_top_ids", [4, 5]), "`teacher_top_ids` has 2 entries and `teacher_top_logprobs` 0; they must"),
    (lambda rows: rows[1].update(teacher_top_ids=[4] * 10, teacher_top_logprobs=[-0.5] * 10),
     "`teacher_top_ids` has 10 entries and `teacher_top_logprobs` 10; they must hold the same k entries per "
     "completion token, 9 tokens here"),
    (_mutate("sample_id", ""), "`sample_id` must be a non-empty string"),
    (_mutate("finished", 1), "`finished` must be a bool"),
    (_mutate("metadata", "{not json"), "`metadata` must be a dict or JSON"),
    (_mutate("group_id", "other"), "must share group_id"),
    (_mutate("sample_id", "w0/g1/s0"), "repeats a sample_id"),
    (lambda rows: rows[1].pop("task"), "missing field"),
]


@pytest.mark.parametrize("mutate, message", BAD_ROWS, ids=[m for _, m in BAD_ROWS])
def test_a_bad_row_is_refused_and_nothing_else_is_lost(tmp_path, mutate, message):
    bad = expected_group("w0", 1)
    mutate(bad)
    with StreamWriter(tmp_path, TOPIC, "w0", cfg_()) as w:
        w.write_group(expected_group("w0", 0))
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            w.write_group(bad)
        w.write_group(expected_group("w0", 2))
    groups = read_all(StreamReader(tmp_path, TOPIC, cfg_()))
    assert ids_of(groups) == [r["sample_id"] for g in (0, 2) for r in expected_group("w0", g)]


def test_a_bad_value_names_its_sample(tmp_path):
    bad = expected_group("w0", 1)
    bad[2]["versions"] = ["x"] * len(bad[2]["versions"])
    with StreamWriter(tmp_path, TOPIC, "w0", cfg_()) as w, pytest.raises(ValueError, match="w0/g1/s2"):
        w.write_group(bad)


def test_rows_without_the_episode_fields_are_single_turn_completions(tmp_path):
    new_fields = ("loss_mask", "turns", "tool_calls", "tool_errors", "end_reason")
    plain = [{k: v for k, v in r.items() if k not in new_fields} for r in expected_group("w0", 1)]
    numpy_rows = [dict(r, versions=np.array(r["versions"], np.int32)) for r in plain]
    dataclass_rows = [Rollout(**{k: v for k, v in r.items() if k not in new_fields}) for r in expected_group("w0", 4)]
    with StreamWriter(tmp_path, TOPIC, "w0", cfg_()) as w:
        w.write_group(plain)
        w.write_group([dict(r, group_id="w0/g1n", sample_id=r["sample_id"] + "n") for r in numpy_rows])
        w.write_group(dataclass_rows)
    for batch in read_all(StreamReader(tmp_path, TOPIC, cfg_())):
        for row in batch.to_pylist():
            assert row["loss_mask"] == [1] * len(row["completion_token_ids"])
            assert (row["turns"], row["tool_calls"], row["tool_errors"]) == (1, 0, 0)
            assert row["end_reason"] == ("finished" if row["finished"] else "truncated")


def _episode_mutation(key, value):
    """Set a field of sample 1 of the episode group 2 (3 completion tokens: model, environment, model)."""
    return lambda rows: rows[1].__setitem__(key, value)


BAD_EPISODES = [
    (_episode_mutation("loss_mask", [1, 0]), "`loss_mask` has 2 entries but the completion has 3 tokens"),
    (_episode_mutation("loss_mask", [1, 2, 1]), "completion token 1: `loss_mask` holds 2"),
    (_episode_mutation("loss_mask", [1, 300, 1]), "`loss_mask` does not fit int8"),
    (_episode_mutation("loss_mask", [1, 1, 1]), "completion token 1: loss_mask 1 (a model token) but version -1"),
    (_episode_mutation("versions", [0, 0, 1]), "completion token 1: loss_mask 0 (an environment token) but version 0"),
    (_episode_mutation("versions", [0, -1, -1]), "completion token 2: loss_mask 1 (a model token) but version -1"),
    (lambda rows: rows[1].pop("loss_mask"), "completion token 1: loss_mask 1 (a model token) but version -1"),
    (_episode_mutation("turns", -1), "`turns` must be an int >= 0"),
    (_episode_mutation("tool_errors", 1.5), "`tool_errors` must be an int >= 0"),
    (_episode_mutation("end_reason", ""), "`end_reason` must be a non-empty string"),
]


@pytest.mark.parametrize("mutate, message", BAD_EPISODES, ids=[m for _, m in BAD_EPISODES])
def test_a_bad_loss_mask_or_episode_field_is_refused_naming_its_sample(tmp_path, mutate, message):
    bad = expected_group("w0", 2)
    assert bad[1]["loss_mask"] == [1, 0, 1] and bad[1]["versions"] == [0, -1, 1]
    mutate(bad)
    with StreamWriter(tmp_path, TOPIC, "w0", cfg_()) as w:
        with pytest.raises(ValueError, match=r"sample_id='w0/g2/s1'.*" + re.escape(message)):
            w.write_group(bad)
        w.write_group(expected_group("w0", 2))
    assert ids_of(read_all(StreamReader(tmp_path, TOPIC, cfg_()))) == [r["sample_id"] for r in expected_group("w0", 2)]


def _segment_groups(tmp_path, writer="w0") -> list[list[int]]:
    return [[b.num_rows for b in load_segment(s)[0]] for s in list_segments(tmp_path / "streams" / TOPIC / writer)]


def test_segments_roll_by_rows_and_never_split_a_group(tmp_path):
    with StreamWriter(tmp_path, TOPIC, "w0", cfg_(segment_max_rows=10)) as w:
        for g in range(5):
            w.write_group(expected_group("w0", g, size=3))  # 3 groups (9 rows) fit; a 4th would make 12
        w.write_group(expected_group("w0", 5, size=13))  # larger than the limit: a segment of its own
    assert _segment_groups(tmp_path) == [[3, 3, 3], [3, 3], [13]]


def test_segments_roll_by_bytes(tmp_path):
    size = group_batch(expected_group("w0", 0)).nbytes
    write_groups(tmp_path, "w0", range(6), cfg_(segment_max_rows=1000, segment_max_bytes=int(size * 2.5)))
    assert all(len(groups) <= 3 for groups in _segment_groups(tmp_path))
    assert sum(len(groups) for groups in _segment_groups(tmp_path)) == 6
    assert len(_segment_groups(tmp_path)) >= 2


def test_a_failed_background_publish_is_raised_and_nothing_after_it_is_published(tmp_path, monkeypatch):
    """Segments publish in a background thread; a failure surfaces on the next call and the stream
    stays a gap-free prefix of what was written."""
    import pipelinerl.streams.writer as writer_module

    real_publish = writer_module.publish

    def fail_segment_1(wdir, seq, batches, totals, fsync):
        if seq == 1:
            raise OSError("disk full")
        return real_publish(wdir, seq, batches, totals, fsync)

    monkeypatch.setattr(writer_module, "publish", fail_segment_1)
    w = StreamWriter(tmp_path, TOPIC, "w0", cfg_(segment_max_rows=4))  # one group of G=4 per segment
    w.write_group(expected_group("w0", 0))
    w.flush()
    w.write_group(expected_group("w0", 1))  # sealed; its publish fails in the background
    with pytest.raises(RuntimeError, match="failed to publish") as err:
        w.flush()
    assert isinstance(err.value.__cause__, OSError)
    with pytest.raises(RuntimeError, match="failed to publish"):
        w.write_group(expected_group("w0", 2))
    with pytest.raises(RuntimeError, match="failed to publish"):
        w.close()
    assert w.segments_published == 1 and [s.seq for s in list_segments(tmp_path / "streams" / TOPIC / "w0")] == [0]
    assert ids_of(read_all(StreamReader(tmp_path, TOPIC, cfg_()))) == [r["sample_id"] for r in expected_group("w0", 0)]


def test_an_idle_writer_publishes_after_segment_max_seconds(tmp_path):
    """The actor may sit in the lag throttle waiting for the trainer, which waits for these samples."""
    w = StreamWriter(tmp_path, TOPIC, "w0", cfg_(segment_max_rows=1000, segment_max_seconds=0.2))
    start = time.monotonic()  # before the write: the group's age counts from its arrival (>= 0.2 s by construction)
    w.write_group(expected_group("w0", 0))
    groups = StreamReader(tmp_path, TOPIC, cfg_()).read_groups(1, timeout_s=60.0)
    # published by its age alone (nothing else comes): at 0.2 s, not at cfg_'s 60 s nor the library's default 5 s
    # (the slack is for a loaded machine's thread wake-ups and fsync)
    assert 0.2 <= time.monotonic() - start < 4.0
    check_group(groups[0])
    w.close()


def test_restarted_writer_removes_its_temp_file_and_continues_numbering(tmp_path, caplog):
    write_groups(tmp_path, "w0", range(4), cfg_(), flush_every=2)  # segments 0 and 1
    wdir = tmp_path / "streams" / TOPIC / "w0"
    (wdir / ".00000002.tmp").write_bytes(b"half a segment")
    with caplog.at_level(logging.WARNING):
        write_groups(tmp_path, "w0", range(4, 6), cfg_())
    assert "removing unpublished temporary segment" in caplog.text
    assert not list(wdir.glob(".*"))
    assert [s.seq for s in list_segments(wdir)] == [0, 1, 2]
    assert ids_of(read_all(StreamReader(tmp_path, TOPIC, cfg_()))) == ids_of(
        [pa.RecordBatch.from_pylist(expected_group("w0", g), ROLLOUT_SCHEMA) for g in range(6)])


def test_reader_follows_writers_that_appear_later_in_a_deterministic_order(tmp_path):
    write_groups(tmp_path, "a", range(6), cfg_(), flush_every=1)
    write_groups(tmp_path, "b", range(3), cfg_(), flush_every=1)
    reader = StreamReader(tmp_path, TOPIC, cfg_())
    first = reader.read_groups(4, timeout_s=1.0)
    write_groups(tmp_path, "c", range(2), cfg_(), flush_every=1)
    rest = read_all(reader)
    order = [b.column("group_id")[0].as_py() for b in first + rest]
    # round-robin over writers among the segments visible at each listing
    assert order == ["a/g0", "b/g0", "a/g1", "b/g1", "a/g2", "b/g2", "a/g3", "a/g4", "a/g5", "c/g0", "c/g1"]
    again = read_all(StreamReader(tmp_path, TOPIC, cfg_()))
    assert [b.column("group_id")[0].as_py() for b in again] == sorted(order, key=lambda x: (
        int(x.split("/g")[1]), x.split("/")[0]))
    for b in again:
        check_group(b)


def _publish_bytes(wdir: Path, seq: int, data: bytes) -> None:
    """A segment file with a valid name and checksum whatever its content."""
    segment_path(wdir, seq, zlib.crc32(data)).write_bytes(data)


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_damaged_segments_are_moved_aside_logged_and_skipped(tmp_path, caplog):
    write_groups(tmp_path, "w0", range(5), cfg_(), flush_every=1)
    wdir = tmp_path / "streams" / TOPIC / "w0"
    segs = list_segments(wdir)
    _flip_byte(segs[1].path, segs[1].path.stat().st_size // 2)  # a token value: only the CRC sees it
    with open(segs[2].path, "r+b") as f:
        f.truncate(segs[2].path.stat().st_size // 3)
    _publish_bytes(wdir, 7, b"not arrow at all, checksum fine")  # CRC ok, decode fails
    reader = StreamReader(tmp_path, TOPIC, cfg_())
    with caplog.at_level(logging.ERROR):
        groups = read_all(reader)
    assert [b.column("group_id")[0].as_py() for b in groups] == ["w0/g0", "w0/g3", "w0/g4"]
    for b in groups:
        check_group(b)
    assert reader.corrupt_segments == 3
    assert sorted(p.name.split(".")[0] for p in wdir.glob("*.corrupt")) == ["00000001", "00000002", "00000007"]
    assert caplog.text.count("is damaged") == 3 and "checksum mismatch" in caplog.text
    assert read_all(StreamReader(tmp_path, TOPIC, cfg_())) != []  # the rest stays readable


def test_a_segment_from_another_schema_version_is_an_error_not_corruption(tmp_path):
    wdir = tmp_path / "streams" / TOPIC / "w0"
    wdir.mkdir(parents=True)
    schema = ROLLOUT_SCHEMA.with_metadata({SCHEMA_VERSION_KEY: str(SCHEMA_VERSION + 1).encode()})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as f:
        f.write_batch(pa.RecordBatch.from_pylist(expected_group("w0", 0), schema))
    _publish_bytes(wdir, 0, sink.getvalue().to_pybytes())
    with pytest.raises(ValueError, match=f"schema version {SCHEMA_VERSION + 1}"):
        StreamReader(tmp_path, TOPIC, cfg_()).read_groups(1, 1.0)
    assert not list(wdir.glob("*.corrupt"))


def test_a_segment_of_the_previous_schema_version_is_refused_naming_both_versions(tmp_path):
    """A version-4 segment (no routed-experts column) is an error that says what was found and what this reader
    expects, not data read with guessed defaults, nor corruption."""
    wdir = tmp_path / "streams" / TOPIC / "w0"
    wdir.mkdir(parents=True)
    v5_only = ("routed_experts",)
    v4 = pa.schema([f for f in ROLLOUT_SCHEMA if f.name not in v5_only], metadata={SCHEMA_VERSION_KEY: b"4"})
    rows = [{k: v for k, v in r.items() if k not in v5_only} for r in expected_group("w0", 0)]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, v4) as f:
        f.write_batch(pa.RecordBatch.from_pylist([dict(r, written_at=0.0) for r in rows], v4))
    _publish_bytes(wdir, 0, sink.getvalue().to_pybytes())
    assert SCHEMA_VERSION == 5
    expected = "has rollout schema version 4; this reader expects version 5 .*older pipelinerl"
    with pytest.raises(ValueError, match=expected):
        StreamReader(tmp_path, TOPIC, cfg_()).read_groups(1, 1.0)
    assert not list(wdir.glob("*.corrupt"))


def _all_ids(writers: dict[str, int]) -> Counter:
    return Counter(r["sample_id"] for w, n in writers.items() for g in range(n) for r in expected_group(w, g))


def test_resume_from_a_saved_cursor_after_crashes_loses_and_repeats_nothing(tmp_path):
    writers = {"a": 23, "b": 17, "c": 9}
    for w, n in writers.items():
        write_groups(tmp_path, w, range(n), cfg_(segment_max_rows=random.Random(w).choice([4, 8, 12])))
    rng = random.Random(0)
    trained, since_checkpoint = [], []
    checkpoint = None
    reader = StreamReader(tmp_path, TOPIC, cfg_())
    while True:
        try:
            batch = reader.read_groups(rng.randint(1, 5), timeout_s=0.1)
        except StreamTimeout:
            break
        since_checkpoint += ids_of(batch)
        event = rng.random()
        if event < 0.3:  # checkpoint: the cursor goes to disk as JSON, the samples are committed
            checkpoint = json.dumps(reader.cursor())
            trained += since_checkpoint
            since_checkpoint = []
        elif event < 0.5:  # crash: work since the checkpoint is lost; resume from its cursor
            since_checkpoint = []
            reader = StreamReader(tmp_path, TOPIC, cfg_(), cursor=json.loads(checkpoint) if checkpoint else None)
    trained += since_checkpoint
    assert Counter(trained) == _all_ids(writers)


def test_duplicate_sample_ids_are_dropped(tmp_path):
    with StreamWriter(tmp_path, TOPIC, "a", cfg_(segment_max_rows=4)) as w:
        for g in range(6):
            w.write_group(expected_group("a", g))
        w.write_group(expected_group("a", 2))  # a whole group again (a replaying actor)
        w.write_group(expected_group("a", 3)[1:3])  # two samples again
        w.write_group(expected_group("a", 6)[:2])  # new
    single = StreamReader(tmp_path, TOPIC, cfg_())
    want = _all_ids({"a": 6}) + Counter(r["sample_id"] for r in expected_group("a", 6)[:2])
    assert Counter(ids_of(read_all(single))) == want
    assert single.duplicates_dropped == G + 2


def test_the_dedup_memory_bound_is_real(tmp_path):
    write_groups(tmp_path, "a", [0, 1, 2, 0], cfg_())
    bounded = StreamReader(tmp_path, TOPIC, cfg_(dedup_window=2 * G))
    assert len(ids_of(read_all(bounded))) == 4 * G  # group 0 is 3 groups back: forgotten
    tight = StreamReader(tmp_path, TOPIC, cfg_(dedup_window=3 * G))
    assert len(ids_of(read_all(tight))) == 3 * G


def test_retention_deletes_only_what_the_saved_cursor_passed(tmp_path):
    write_groups(tmp_path, "a", range(10), cfg_(), flush_every=1)  # one group per segment
    wdir = tmp_path / "streams" / TOPIC / "a"
    reader = StreamReader(tmp_path, TOPIC, cfg_())
    consumed = ids_of(reader.read_groups(4, 1.0))
    cursor = json.loads(json.dumps(reader.cursor()))  # as saved in the checkpoint
    assert release(tmp_path, TOPIC, cursor, cfg_()) == []  # retention: keep
    bound = cursor["next"]["a"][0]
    assert bound == 4
    deleted = release(tmp_path, TOPIC, cursor, cfg_(retention="delete"))
    assert sorted(int(Path(p).name[:8]) for p in deleted) == list(range(bound))
    assert [s.seq for s in list_segments(wdir)] == list(range(bound, 10))
    consumed += ids_of(read_all(StreamReader(tmp_path, TOPIC, cfg_(), cursor=cursor)))  # nothing unread was deleted
    assert Counter(consumed) == _all_ids({"a": 10})


def test_a_writer_restarted_after_release_continues_past_every_cursor(tmp_path):
    write_groups(tmp_path, "a", range(3), cfg_(), flush_every=1)
    reader = StreamReader(tmp_path, TOPIC, cfg_())
    assert len(read_all(reader)) == 3
    release(tmp_path, TOPIC, reader.cursor(), cfg_(retention="delete"))
    wdir = tmp_path / "streams" / TOPIC / "a"
    assert [s.seq for s in list_segments(wdir)] == [2]  # the newest stays as the high-water mark
    write_groups(tmp_path, "a", range(3, 5), cfg_(), flush_every=1)
    resumed = StreamReader(tmp_path, TOPIC, cfg_(), cursor=reader.cursor())
    assert ids_of(read_all(resumed)) == [r["sample_id"] for g in (3, 4) for r in expected_group("a", g)]


def test_release_keeps_the_newest_published_segment_so_a_restarted_writer_keeps_its_totals(tmp_path):
    """A writer killed mid-publish leaves a temporary file with a higher number than its newest segment;
    the trainer then releases everything it consumed. The newest published segment must stay: it holds
    the writer's totals, from which the restarted writer (and its actor) counts on."""
    write_groups(tmp_path, "a", range(3), cfg_(), flush_every=1)  # segments 0, 1, 2: one group each
    wdir = tmp_path / "streams" / TOPIC / "a"
    (wdir / ".00000003.tmp").write_bytes(b"half a segment")
    reader = StreamReader(tmp_path, TOPIC, cfg_())
    assert len(read_all(reader)) == 3
    release(tmp_path, TOPIC, reader.cursor(), cfg_(retention="delete"))
    assert [s.seq for s in list_segments(wdir)] == [2]
    assert writer_totals(wdir) == WriterTotals(groups=3, rows=3 * G)
    write_groups(tmp_path, "a", [3, 4], cfg_(), flush_every=1)  # restarted: removes the .tmp, continues
    assert [s.seq for s in list_segments(wdir)] == [2, 3, 4]
    assert writer_totals(wdir) == WriterTotals(groups=5, rows=5 * G)
    resumed = StreamReader(tmp_path, TOPIC, cfg_(), cursor=reader.cursor())
    assert ids_of(read_all(resumed)) == [r["sample_id"] for g in (3, 4) for r in expected_group("a", g)]


def test_writer_totals_count_groups_and_rows_over_restarts_and_skip_a_damaged_newest_segment(tmp_path):
    wdir = tmp_path / "streams" / TOPIC / "a"
    assert writer_totals(wdir) == WriterTotals()
    with StreamWriter(tmp_path, TOPIC, "a", cfg_()) as w:
        w.write_group(expected_group("a", 0, size=3))
        w.write_group(expected_group("a", 1, size=2))
        w.flush()
        w.write_group(expected_group("a", 2, size=4))
    assert writer_totals(wdir) == WriterTotals(groups=3, rows=9)
    write_groups(tmp_path, "a", [3], cfg_())
    assert writer_totals(wdir) == WriterTotals(groups=4, rows=13)
    newest = list_segments(wdir)[-1].path
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    assert writer_totals(wdir) == WriterTotals(groups=3, rows=9)  # as the trainer sees it: group 3 never came


def test_read_times_out_with_a_message_naming_the_folder(tmp_path):
    reader = StreamReader(tmp_path, TOPIC, cfg_())
    start = time.monotonic()
    with pytest.raises(StreamTimeout, match=str(tmp_path / "streams" / TOPIC)):
        reader.read_groups(2, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - start < 5.0  # at its timeout, give or take a loaded machine's wake-up
    write_groups(tmp_path, "a", range(1), cfg_())
    assert len(reader.read_groups(2, timeout_s=0.3)) == 1  # a short read returns what arrived


def test_inspect_counts_tokens_rewards_and_lag(tmp_path, capsys):
    write_groups(tmp_path, "a", range(4), cfg_(), flush_every=2)
    write_groups(tmp_path, "b", range(3), cfg_())
    (tmp_path / "streams" / TOPIC / "b" / ".00000009.tmp").write_bytes(b"x")
    rows = [expected_row(w, g, i) for w, n in (("a", 4), ("b", 3)) for g in range(n) for i in range(G)]
    report = inspect(tmp_path)["topics"][TOPIC]
    total = report["total"]
    assert total["samples"] == len(rows) and total["groups"] == 7
    assert total["completion_tokens"] == sum(len(r["completion_token_ids"]) for r in rows)
    assert total["prompt_tokens"] == sum(len(r["prompt_token_ids"]) for r in rows)
    assert total["reward_mean"] == pytest.approx(sum(r["reward"] for r in rows) / len(rows))
    model = [[v for v, m in zip(r["versions"], r["loss_mask"]) if m] for r in rows]  # environment tokens: no lag
    assert total["model_tokens"] == sum(map(len, model)) < total["completion_tokens"]
    spread = Counter(max(v) - min(v) for v in model)
    stale = Counter(max(vs) - v for vs in model for v in vs)
    assert total["spread_histogram"] == dict(spread) and total["token_staleness_histogram"] == dict(stale)
    assert report["writers"]["a"]["segments"] == 2 and report["writers"]["b"]["unpublished_temp_files"] == 1
    assert cli_main(["streams", "inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "in-flight spread" in out and f"{len(rows):>9}" in out
    assert cli_main(["streams", "inspect", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["topics"][TOPIC]["total"]["samples"] == len(rows)


def test_streams_config_fields_are_validated():
    with pytest.raises(ConfigError, match="streams.dedup_window"):
        load_config(None, ["run_dir=x", "model.path=m", "streams.dedup_window=0"])
    with pytest.raises(ConfigError, match="streams.retention"):
        StreamsConfig(retention="sometimes")
    assert load_config(None, ["run_dir=x", "model.path=m", "streams.dedup_window=null"]).streams.dedup_window is None


def test_bad_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match="writer_id"):
        StreamWriter(tmp_path, TOPIC, "../escape", cfg_())
    assert os.listdir(tmp_path) == []
