"""Rollout streams with real processes: concurrent writers, writers and a reader killed with SIGKILL.

Children are started with `spawn` (a fresh interpreter, as separate actor programs would be).
"""

import json
import multiprocessing as mp
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

from test_streams import TOPIC, check_group, expected_group, ids_of, read_all

from pipelinerl.config import StreamsConfig
from pipelinerl.streams import StreamReader, StreamTimeout, StreamWriter

SPAWN = mp.get_context("spawn")


def _cfg(**kw) -> StreamsConfig:
    return StreamsConfig(**{"segment_max_rows": 8, "segment_max_seconds": 60.0, "poll_interval_s": 0.02, **kw})


def _write(run_dir: str, writer: str, n_groups: int, max_rows: int, seed: int) -> None:
    rng = random.Random(seed)
    with StreamWriter(run_dir, TOPIC, writer, _cfg(segment_max_rows=max_rows, segment_max_seconds=0.05)) as w:
        for g in range(n_groups):
            w.write_group(expected_group(writer, g))
            time.sleep(rng.random() * 0.01)


def _write_until_killed(run_dir: str, writer: str) -> None:
    with StreamWriter(run_dir, TOPIC, writer, _cfg()) as w:  # segments of 2 groups
        g = 0
        while True:
            w.write_group(expected_group(writer, g))
            g += 1


def _freeze_before_rename(run_dir: str, writer: str, published: int, frozen) -> None:
    """Publish `published` groups, then freeze in the fsync of the next segment's temporary file."""
    w = StreamWriter(run_dir, TOPIC, writer, _cfg(segment_max_rows=1000))
    for g in range(published):
        w.write_group(expected_group(writer, g))
    w.flush()

    def freeze(fd: int) -> None:
        frozen.set()
        time.sleep(600)

    os.fsync = freeze
    for g in range(published, published + 3):
        w.write_group(expected_group(writer, g))
    w.flush()


def _read_then_die(run_dir: str, checkpoint: str, batches: int) -> None:
    """A trainer: read, checkpoint (cursor + trained ids) every 3rd batch, SIGKILL itself mid-way."""
    reader = StreamReader(run_dir, TOPIC, _cfg())
    trained = []
    for n in range(1, batches + 1):
        trained += ids_of(reader.read_groups(3, timeout_s=10.0))
        if n % 3 == 0:
            tmp = Path(checkpoint + ".tmp")
            tmp.write_text(json.dumps({"cursor": reader.cursor(), "trained": trained}))
            tmp.replace(checkpoint)
    os.kill(os.getpid(), signal.SIGKILL)


def _start(target, *args) -> mp.Process:
    proc = SPAWN.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def _expected(writers: dict[str, int]) -> Counter:
    return Counter(r["sample_id"] for w, n in writers.items() for g in range(n) for r in expected_group(w, g))


def test_concurrent_writer_processes_deliver_every_sample_exactly_once(tmp_path):
    writers = {"actor0": 60, "actor1": 45, "actor2": 30}
    procs = [_start(_write, str(tmp_path), w, n, [4, 8, 12][i], i) for i, (w, n) in enumerate(writers.items())]
    reader = StreamReader(tmp_path, TOPIC, _cfg())
    got, deadline = [], time.monotonic() + 60
    while sum(b.num_rows for b in got) < sum(_expected(writers).values()) and time.monotonic() < deadline:
        assert all(p.exitcode in (None, 0) for p in procs), "a writer process failed"
        try:
            got += reader.read_groups(8, timeout_s=0.5)  # reading while the writers write
        except StreamTimeout:
            pass
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    got += read_all(reader)
    assert Counter(ids_of(got)) == _expected(writers)
    for batch in got:
        check_group(batch)


def test_a_writer_killed_between_write_and_rename_leaves_nothing_visible(tmp_path):
    frozen = SPAWN.Event()
    proc = _start(_freeze_before_rename, str(tmp_path), "actor0", 5, frozen)
    assert frozen.wait(60), "the writer never reached the fsync of its second segment"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    wdir = tmp_path / "streams" / TOPIC / "actor0"
    (tmp,) = wdir.glob(".*.tmp")
    assert tmp.stat().st_size > 0  # the partial segment is on disk...
    reader = StreamReader(tmp_path, TOPIC, _cfg())
    assert Counter(ids_of(read_all(reader))) == _expected({"actor0": 5})  # ...and invisible
    with StreamWriter(tmp_path, TOPIC, "actor0", _cfg()) as w:  # the actor restarts
        assert not tmp.exists()
        w.write_group(expected_group("actor0", 8))
    assert ids_of(read_all(reader)) == [r["sample_id"] for r in expected_group("actor0", 8)]


def test_writers_killed_at_random_times_leave_only_whole_groups(tmp_path):
    procs = {w: _start(_write_until_killed, str(tmp_path), w) for w in ("actor0", "actor1")}
    rng = random.Random(1)
    for writer, proc in procs.items():
        deadline = time.monotonic() + 60
        while not list((tmp_path / "streams" / TOPIC / writer).glob("*.arrow")) and time.monotonic() < deadline:
            assert proc.is_alive(), "the writer process failed"
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    groups = read_all(StreamReader(tmp_path, TOPIC, _cfg()))
    for writer in procs:
        mine = [b for b in groups if b.column("actor_id")[0].as_py() == writer]
        numbers = [int(b.column("group_id")[0].as_py().rsplit("/g", 1)[1]) for b in mine]
        assert numbers and numbers == list(range(len(numbers)))  # a prefix of what it wrote: no gap
        assert len(numbers) % 2 == 0  # whole segments of 2 groups
        for batch in mine:
            check_group(batch)


def test_a_reader_killed_mid_run_resumes_from_its_checkpoint_cursor(tmp_path):
    writers = {"actor0": 20, "actor1": 13}
    for i, (w, n) in enumerate(writers.items()):
        _write(str(tmp_path), w, n, max_rows=12, seed=i)
    checkpoint = str(tmp_path / "checkpoint.json")
    proc = _start(_read_then_die, str(tmp_path), checkpoint, 7)  # dies after batch 7, saved at batch 6
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    saved = json.loads(Path(checkpoint).read_text())
    assert len(saved["trained"]) == 6 * 3 * 4
    resumed = StreamReader(tmp_path, TOPIC, _cfg(), cursor=saved["cursor"])
    assert Counter(saved["trained"] + ids_of(read_all(resumed))) == _expected(writers)
