"""The trainer's sweep of stale torch JIT-extension locks (pipelinerl/trainer/jit_locks.py): a lock that no
process on this host holds and that is older than trainer.jit_lock_stale_s is removed, any other is kept."""

import logging
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from pipelinerl.config import ConfigError, TrainerConfig, load_config
from pipelinerl.trainer import jit_locks
from pipelinerl.trainer.jit_locks import sweep_jit_locks

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny_cpu.yaml"
STALE_S = 600.0
HOLD = "import os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); print('ok', flush=True); time.sleep(60)"


def make_lock(folder, op="deepspeed_shm_comm", age_s=0.0, name="lock"):
    """A lock file as torch's FileBaton leaves it (empty), its mtime age_s seconds ago."""
    (folder / op).mkdir(parents=True, exist_ok=True)
    path = folder / op / name
    os.close(os.open(path, os.O_CREAT | os.O_EXCL))
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def seconds(pattern, message):
    """The whole seconds a log line states (the sweep runs a moment after the lock was made)."""
    return int(re.search(pattern, message).group(1))


def test_a_stale_unheld_lock_is_removed_with_a_warning(tmp_path, caplog):
    lock = make_lock(tmp_path, age_s=STALE_S + 100)
    with caplog.at_level(logging.INFO, logger="pipelinerl.trainer.jit_locks"):
        assert sweep_jit_locks(tmp_path, STALE_S) == [lock]
    assert not lock.exists()
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = record.getMessage()
    assert str(lock) in message and 700 <= seconds(r"(\d+) s old", message) < 760
    assert "no process on this host holds it" in message and "jit_lock_stale_s = 600" in message


def test_a_lock_held_open_by_a_live_process_is_kept_however_old(tmp_path, caplog):
    lock = make_lock(tmp_path, age_s=10 * STALE_S)
    link = tmp_path.parent / f"{tmp_path.name}-link"  # the sweep compares real paths, as /proc/<pid>/fd holds them
    link.symlink_to(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ok"
        with caplog.at_level(logging.INFO, logger="pipelinerl.trainer.jit_locks"):
            assert sweep_jit_locks(link, STALE_S) == []
        assert lock.exists()
        assert not [r for r in caplog.records if r.levelno >= logging.INFO]
    finally:
        holder.kill()
        holder.wait()
        link.unlink()
    assert sweep_jit_locks(tmp_path, STALE_S) == [lock]  # its holder gone, the same lock is stale


def test_a_fresh_unheld_lock_is_kept_and_says_when_it_counts_as_stale(tmp_path, caplog):
    lock = make_lock(tmp_path, age_s=100)
    with caplog.at_level(logging.INFO, logger="pipelinerl.trainer.jit_locks"):
        assert sweep_jit_locks(tmp_path, STALE_S) == []
    assert lock.exists()
    [record] = caplog.records
    assert record.levelno == logging.INFO
    assert str(lock) in record.getMessage() and 440 < seconds(r"stale in (\d+) s", record.getMessage()) <= 500


def test_only_lock_files_one_level_down_are_swept(tmp_path):
    others = [make_lock(tmp_path, age_s=10 * STALE_S, name="build.ninja"),
              make_lock(tmp_path, age_s=10 * STALE_S, name="lock.old"),
              make_lock(tmp_path, op="a/b", age_s=10 * STALE_S)]
    top = tmp_path / "lock"
    top.touch()
    os.utime(top, (0, 0))
    stale = make_lock(tmp_path, op="cpu_adam", age_s=10 * STALE_S)
    assert sweep_jit_locks(tmp_path, STALE_S) == [stale]
    assert all(p.exists() for p in [*others, top])
    assert sweep_jit_locks(tmp_path / "missing", STALE_S) == []


def test_a_lock_taken_anew_during_the_sweep_is_kept(tmp_path, monkeypatch):
    """Another rank of this host may remove the stale lock and take a new one for its build meanwhile."""
    lock = make_lock(tmp_path, age_s=10 * STALE_S)

    def another_rank_takes_it(targets):
        lock.unlink()
        make_lock(tmp_path)
        return set()

    monkeypatch.setattr(jit_locks, "open_paths", another_rank_takes_it)
    assert sweep_jit_locks(tmp_path, STALE_S) == []
    assert lock.exists()


def test_init_process_group_sweeps_before_deepspeed_loads_anything(tmp_path, monkeypatch):
    from pipelinerl.trainer.dist import DistInfo, init_process_group

    lock = make_lock(tmp_path, age_s=STALE_S + 1)
    seen = []
    fake = types.SimpleNamespace(init_distributed=lambda **kw: seen.append(lock.exists()))
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    for name, value in (("TORCH_EXTENSIONS_DIR", str(tmp_path)), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    init_process_group(DistInfo(rank=0, world_size=1, local_rank=0, backend="gloo"), 60, STALE_S)
    assert seen == [False]


@pytest.mark.parametrize("bound", [0.0, -1.0])
def test_the_config_refuses_a_non_positive_bound(bound):
    with pytest.raises(ConfigError, match=f"config `trainer.jit_lock_stale_s`: got {bound!r}; must be > 0"):
        TrainerConfig(jit_lock_stale_s=bound)
    with pytest.raises(ConfigError, match="config `trainer.jit_lock_stale_s`"):
        load_config(TINY, [f"trainer.jit_lock_stale_s={bound}"])
    assert load_config(TINY, ["trainer.jit_lock_stale_s=30"]).trainer.jit_lock_stale_s == 30
