"""Publishing files and folders so that a reader sees them complete or not at all.

Everything is first written under a hidden temporary sibling name (`.<name>.<pid>.tmp`, which no reader
of this project trusts), then renamed into place; rename is atomic within one filesystem.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def temp_sibling(path: Path) -> Path:
    """A hidden temporary name next to `path`, private to this process."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def fsync_path(path: Path) -> None:
    """Flush a file's data (or a folder's entries, i.e. its renames) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path, fsync: bool = True) -> None:
    """Rename a fully written `tmp` over `final`; with fsync, the data and the rename survive a crash."""
    if fsync:
        fsync_path(tmp)
    os.replace(tmp, final)
    if fsync:
        fsync_path(final.parent)


def _written_temp(path: Path, data: str | bytes, mode: int) -> Path:
    """`data` in a new temporary sibling of `path` (folders created), not yet published."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return tmp


def write_file(path: str | Path, data: str | bytes, mode: int = 0o644, fsync: bool = True) -> None:
    """Replace `path` with `data` atomically (file permissions `mode`)."""
    path = Path(path)
    publish(_written_temp(path, data, mode), path, fsync)


def create_file(path: str | Path, data: str | bytes, mode: int = 0o644) -> bool:
    """Create `path` with `data` unless it exists (first creator wins, complete or absent, never
    overwritten); True if this call created it."""
    path = Path(path)
    tmp = _written_temp(path, data, mode)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


@contextmanager
def staged_dir(final: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder; when the block succeeds it replaces `final` (a folder)."""
    final = Path(final)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
