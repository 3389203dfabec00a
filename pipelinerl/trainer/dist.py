"""Rank, world size and the trainer's process group: read once at start-up, then passed in.

torchrun, the `deepspeed` launcher and Slurm+srun (through torchrun) all export RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT; a bare `python` process is rank 0 of 1.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from pipelinerl.netif import LOOPBACK, use_interface
from pipelinerl.trainer.jit_locks import sweep_jit_locks


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the trainer's data-parallel group."""

    rank: int  # global rank; rank 0 gathers weights, broadcasts them and writes checkpoints
    world_size: int  # data-parallel ranks (ZeRO shards over all of them)
    local_rank: int  # rank on this node: picks the GPU
    backend: str  # nccl (GPUs) | gloo (CPU)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def read_dist_env(environ=os.environ) -> DistInfo:
    """The launcher's view of this process; NCCL when CUDA is present, else gloo."""
    import torch

    rank = int(environ.get("RANK", 0))
    world_size = int(environ.get("WORLD_SIZE", 1))
    local_rank = int(environ.get("LOCAL_RANK", 0))
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world_size}; launch with torchrun or deepspeed")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, backend=backend)


def jit_extensions_dir() -> Path:
    """Where torch builds DeepSpeed's CPU shm comm op (loaded by every CPU trainer rank): TORCH_EXTENSIONS_DIR, or
    a folder of this virtual environment. torch's default, ~/.cache/torch_extensions, is shared by every
    environment of the user, and each one rebuilds the op over the other's build (its sources' paths differ)."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path(sys.prefix) / "torch_extensions")


def init_process_group(info: DistInfo, timeout_s: float, jit_lock_stale_s: float) -> None:
    """Join the trainer's default group. A collective that waits longer than timeout_s fails (no hang).
    DeepSpeed JIT-loads its ops from here on (the CPU shm comm op in init_distributed, others when the engine
    is built), all under TORCH_EXTENSIONS_DIR; a lock left there by a killed build (unheld on this host and
    older than jit_lock_stale_s seconds) is removed first, or every load would wait on it forever."""
    folder = jit_extensions_dir()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(folder)
    sweep_jit_locks(folder, jit_lock_stale_s)
    import deepspeed
    import torch

    os.environ.setdefault("MASTER_ADDR", LOOPBACK)
    os.environ.setdefault("MASTER_PORT", "29500")
    if info.world_size > 1:
        use_interface(os.environ["MASTER_ADDR"])  # gloo's and NCCL's sockets: not a loopback name (netif.py)
    if info.backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    deepspeed.init_distributed(dist_backend=info.backend, timeout=timedelta(seconds=timeout_s),
                               rank=info.rank, world_size=info.world_size, verbose=False)


def close_process_group() -> None:
    """Leave the default group before the process exits. A rank that exits with it still up aborts at random
    in the C++ teardown ("terminate called without an active exception", SIGABRT: 4 of 15 two-rank gloo
    exits on this machine, none of 15 after this), which a launcher reads as a crash."""
    import torch

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def all_reduce_max(value: int) -> int:
    """The largest of every rank's value (micro-batch counts, stop flags)."""
    import torch

    return int(all_reduce_tensor(torch.tensor([value], dtype=torch.long), "max").item())


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sums over ranks (sample counts, losses for logging)."""
    import torch

    return all_reduce_tensor(torch.tensor(values, dtype=torch.float64), "sum").tolist()


def all_reduce_tensor(t, op: str):
    """A CPU tensor reduced over ranks (op: sum | max), returned on CPU; NCCL needs a device copy."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return t
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    work = t.to(device, copy=True)
    dist.all_reduce(work, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return work.cpu()


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
