"""Stale lock files of torch's JIT extension builds, removed before a trainer loads one.

torch.utils.cpp_extension's JIT `load` (DeepSpeed builds its CPU shm comm op, `deepspeed_shm_comm`, and other
ops with it) holds `<TORCH_EXTENSIONS_DIR>/<extension>/lock` while it checks or builds the extension: a
`torch.utils.file_baton.FileBaton`, created with O_CREAT | O_EXCL, kept open while held and removed on release.
Every other loader spins while the file exists, with no timeout, so a process killed while holding it leaves a
file that hangs every later trainer. A lock is stale when no process on this host holds it open and it is older
than a bound: another node sharing the folder over a network filesystem may be building (a build takes a minute
or two), and its processes are invisible here.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)


def sweep_jit_locks(folder: Path, stale_s: float) -> list[Path]:
    """Remove every `<folder>/*/lock` that no process on this host holds open and that is older than stale_s
    seconds (its mtime is when it was taken); return the removed paths. Each removal is a warning."""
    stats = {}
    for lock in sorted(Path(folder).glob("*/lock")):
        try:
            stats[lock] = lock.stat()
        except FileNotFoundError:  # released meanwhile
            continue
    held = open_paths({os.path.realpath(lock) for lock in stats})
    removed = []
    for lock, st in stats.items():
        age_s = time.time() - st.st_mtime
        if os.path.realpath(lock) in held:
            log.debug("JIT extension lock %s (%.0f s old) is held by a process on this host: kept", lock, age_s)
        elif age_s <= stale_s:
            log.info("JIT extension lock %s is %.0f s old and held by no process on this host: kept (another node "
                     "sharing the folder may be building); it counts as stale in %.0f s (trainer.jit_lock_stale_s "
                     "= %g)", lock, age_s, stale_s - age_s, stale_s)
        elif _unlink_if_same(lock, st):
            log.warning("removed stale JIT extension lock %s: %.0f s old, older than trainer.jit_lock_stale_s = %g, "
                        "and no process on this host holds it open (left by a killed process; every JIT load of "
                        "this extension would have waited for it forever)", lock, age_s, stale_s)
            removed.append(lock)
    return removed


def _unlink_if_same(lock: Path, st: os.stat_result) -> bool:
    """Unlink lock unless it was released and taken anew since `st` (another rank of this host may have swept the
    old one and started its own build meanwhile)."""
    try:
        now = lock.stat()
    except FileNotFoundError:
        return False
    if (now.st_ino, now.st_mtime_ns) != (st.st_ino, st.st_mtime_ns):
        return False
    lock.unlink(missing_ok=True)
    return True


def open_paths(targets: set[str]) -> set[str]:
    """Which of targets (real paths) some process on this host holds open, from the `/proc/<pid>/fd` links.
    Processes that exit meanwhile or that this user may not inspect are skipped."""
    found = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            entries = os.scandir(fd_dir)
        except OSError:  # gone, or another user's process
            continue
        with entries:
            for entry in entries:
                try:
                    target = os.readlink(entry.path)
                except OSError:
                    continue
                if target in targets:
                    found.add(target)
    return found
