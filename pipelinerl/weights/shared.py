"""Host staging shared by a server's tensor-parallel workers: one copy of an update per server, not per worker.

Only the server's receiving worker (tensor-parallel rank 0) is a member of the weight-update group. Its
buckets land in files under /dev/shm (`SharedBuffers`); once every byte has arrived, it describes where each
staged tensor lies (`describe`: `StagedRef`s) and the other workers map the same files (`SharedViews`), so
every worker loads the full tensors, each taking its own shard, from the one copy.

A file keeps its name only until the other workers have mapped it (or the update that made it failed): the
receiving worker then removes the name, and the memory lives on while some worker maps it. So a server that
dies frees its staging, except the files of an update it was in the middle of, which the next server on the
node removes (`remove_stale`). Buffers are kept from update to update, as `StagingBuffers` keeps them: the
other workers keep mapping the files of the latest update, and a buffer they do not map is dropped.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from pipelinerl.dtypes import dtype_name, torch_dtype
from pipelinerl.weights.receiver import StagingBuffers
from pipelinerl.weights.wire import itemsize

SHM_DIR = "/dev/shm"
PREFIX = "pipelinerl-weights-"  # then <pid of the receiving worker>-<n>
_serial = itertools.count()


@dataclass(frozen=True)
class StagedRef:
    """Where one staged tensor lies: what the receiving worker hands to the others."""

    name: str  # HF tensor name
    path: str  # the staging file
    file_bytes: int  # its size
    offset: int  # of the tensor's first byte in the file
    dtype: str
    shape: list[int]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


def describe(staged: list[tuple[str, torch.Tensor]]) -> list[StagedRef]:
    """The refs of staged tensors that lie in shared staging files (views into SharedBuffers' buffers)."""
    refs = []
    for name, t in staged:
        storage = t.untyped_storage()
        assert storage.filename is not None and t.is_contiguous(), f"{name} is not in a shared staging file"
        refs.append(StagedRef(name, storage.filename, storage.nbytes(), t.storage_offset() * t.element_size(),
                              dtype_name(t.dtype), list(t.shape)))
    return refs


class SharedBuffers(StagingBuffers):
    """StagingBuffers whose host buffers are files under `directory` (a tmpfs), which the other workers map.

    A pinned buffer (a GPU server's) is this process's mapping registered with CUDA (cudaHostRegister), so the
    receiving worker's device->host copies run asynchronously at full speed; it is unregistered when the
    buffer leaves the set. The other workers' mappings stay pageable (their loads copy from them once)."""

    def __init__(self, directory: str = SHM_DIR) -> None:
        super().__init__()
        self.directory = directory
        self.named: list[str] = []  # files whose names still exist: made since the others last mapped
        self._registered: set[int] = set()  # data pointers of the buffers registered with CUDA
        remove_stale(directory)

    def _host(self, nbytes: int, pinned: bool) -> torch.Tensor:
        path = os.path.join(self.directory, f"{PREFIX}{os.getpid()}-{next(_serial)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.named.append(path)
        try:
            # reserves the tmpfs pages now: a full /dev/shm fails here, not with SIGBUS in the middle of a receive
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as err:
            self.discard_new()
            raise OSError(err.errno, f"cannot stage {nbytes / 1e9:.2f} GB more of a weight update in {self.directory} "
                                     f"({err.strerror}): it must hold one copy of the model per server") from None
        finally:
            os.close(fd)
        buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        if pinned:
            err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of the staging file {path} ({nbytes / 1e9:.2f} GB) failed "
                                   f"with CUDA error {int(err)}")
            self._registered.add(buf.data_ptr())
        return buf

    def _pinned(self, buf: torch.Tensor) -> bool:
        return buf.numel() > 0 and buf.data_ptr() in self._registered

    def _drop(self, buf: torch.Tensor) -> None:
        if self._pinned(buf):
            self._registered.discard(buf.data_ptr())
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())

    def handed_over(self, mapped: set[str]) -> None:
        """The other workers now map the files `mapped` (the latest update's): remove every name, and drop the
        buffers in other files (the others do not map them, and cannot open them any more)."""
        self._unlink_named()
        self._keep(lambda path: path in mapped)

    def discard_new(self) -> None:
        """After a failed update: remove the files the other workers never opened and drop their buffers."""
        new = set(self.named)
        self._unlink_named()
        self._keep(lambda path: path not in new)

    def _keep(self, keep) -> None:
        """Drop the buffers whose file `keep(path)` rejects (the next update allocates new ones there)."""
        for k, buf in enumerate(self._bufs):
            if not keep(buf.untyped_storage().filename):
                self._drop(buf)
                self._bufs[k] = torch.empty(0, dtype=torch.uint8)

    def _unlink_named(self) -> None:
        for path in self.named:
            Path(path).unlink(missing_ok=True)
        self.named = []


class SharedViews:
    """A non-receiving worker's side: the receiving worker's staged tensors, through its own mappings of the
    files (those of the latest update, kept for the next: the receiving worker may reuse them)."""

    def __init__(self) -> None:
        self._maps: dict[str, torch.Tensor] = {}

    def attach(self, refs: list[StagedRef]) -> list[tuple[str, torch.Tensor]]:
        """The (name, tensor) pairs `refs` describe. OSError when a file cannot be mapped (the workers of a
        server must share one node's /dev/shm)."""
        maps = {}
        for ref in refs:
            if ref.path not in maps:
                maps[ref.path] = self._maps.get(ref.path)
                if maps[ref.path] is None:
                    maps[ref.path] = torch.from_file(ref.path, shared=True, size=ref.file_bytes, dtype=torch.uint8)
        self._maps = maps
        return [(ref.name, maps[ref.path][ref.offset:ref.offset + ref.nbytes].view(torch_dtype(ref.dtype))
                 .view(ref.shape)) for ref in refs]


def remove_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove staging files of receiving workers that no longer run (a server killed during an update);
    returns their paths."""
    removed = []
    for path in Path(directory).glob(f"{PREFIX}*-*"):
        pid = path.name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and not _running(int(pid)):
            path.unlink(missing_ok=True)
            removed.append(str(path))
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
