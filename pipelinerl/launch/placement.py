"""GPUs of one node split between the roles: servers (tensor-parallel groups of contiguous GPUs) and
trainer ranks (one GPU each), disjoint. Pure: no torch, no processes; both launchers use it.

The original PipelineRL's everyday shape is one 8-GPU node split between inference and training; a
cluster job with separate inference and training nodes is the same split with one side empty.
"""

from __future__ import annotations

from dataclasses import dataclass


def parse_gpu_ids(spec: str) -> list[str]:
    """`"0-3,6"` -> `["0", "1", "2", "3", "6"]` (as CUDA_VISIBLE_DEVICES takes them); ValueError on bad text."""
    ids: list[str] = []
    for part in str(spec).replace(" ", "").split(","):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"bad GPU list {spec!r}: use ids and ranges like '0-3' or '0,1,4-7'")
        ids += [str(i) for i in range(int(first), int(last if dash else first) + 1)]
    if len(set(ids)) != len(ids):
        raise ValueError(f"GPU list {spec!r} names a GPU twice")
    return ids


def server_gpu_groups(gpus: list[str], num_servers: int, tensor_parallel_size: int) -> list[list[str]]:
    """tensor_parallel_size contiguous GPUs per server, in order."""
    need = num_servers * tensor_parallel_size
    if need > len(gpus):
        raise ValueError(f"inference.num_servers={num_servers} x tensor_parallel_size={tensor_parallel_size} "
                         f"needs {need} GPUs; the servers have {len(gpus)} ({','.join(gpus) or 'none'})")
    return [gpus[i * tensor_parallel_size:(i + 1) * tensor_parallel_size] for i in range(num_servers)]


@dataclass(frozen=True)
class Placement:
    """Where the roles of one node run. None = on CPU (no CUDA_VISIBLE_DEVICES set)."""

    server_gpus: list[list[str]] | None  # per server slot: its GPU ids
    trainer_gpus: list[str] | None  # the trainer ranks' GPUs; rank r uses trainer_gpus[r] (LOCAL_RANK r)
    trainer_ranks: int  # trainer processes on this node

    def describe(self, num_servers: int) -> list[str]:
        """One line per role, for --dry-run."""
        lines = [f"server{i}: GPUs {','.join(self.server_gpus[i])}" if self.server_gpus else f"server{i}: CPU"
                 for i in range(num_servers)]
        where = f"GPUs {','.join(self.trainer_gpus)}" if self.trainer_gpus else "CPU (gloo)"
        return lines + [f"trainer: {self.trainer_ranks} rank(s) on {where}"]


def split_node(node_gpus: int, inference_gpus: str | None, training_gpus: str | None, num_servers: int,
               tensor_parallel_size: int, trainer_ranks: int | None) -> Placement:
    """The one-node split. `node_gpus` = GPUs visible on the node (0 on CPU). Unset GPU lists default to
    seed 001's half/half split: the first half serves, the second half trains."""
    if node_gpus == 0:
        if inference_gpus or training_gpus:
            raise ValueError("launch.inference_gpus / launch.training_gpus are set but this machine has no GPU")
        return Placement(None, None, trainer_ranks or 1)
    half = node_gpus // 2
    serving = parse_gpu_ids(inference_gpus) if inference_gpus else [str(i) for i in range(half)]
    training = parse_gpu_ids(training_gpus) if training_gpus else [str(i) for i in range(half, node_gpus)]
    for name, ids in (("launch.inference_gpus", serving), ("launch.training_gpus", training)):
        if not ids or max(map(int, ids)) >= node_gpus:
            raise ValueError(f"{name} = {','.join(ids) or 'none'} but this node has GPUs 0-{node_gpus - 1}")
    if shared := sorted(set(serving) & set(training), key=int):
        raise ValueError(f"launch.inference_gpus and launch.training_gpus share GPU(s) {','.join(shared)}; "
                         "servers and trainer ranks need disjoint GPUs")
    ranks = trainer_ranks or len(training)
    if ranks > len(training):
        raise ValueError(f"trainer.num_gpus={ranks} trainer ranks need {ranks} GPUs; launch.training_gpus has "
                         f"{len(training)} ({','.join(training)})")
    return Placement(server_gpu_groups(serving, num_servers, tensor_parallel_size), training[:ranks], ranks)
