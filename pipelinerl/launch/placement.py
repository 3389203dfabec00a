"""GPUs of one node split between the roles: servers (tensor-parallel groups of contiguous GPUs) and
trainer ranks (one GPU each), disjoint. Pure: no torch, no processes; both launchers use it.

The original PipelineRL's everyday shape is one 8-GPU node split between inference and training; a
cluster job with separate inference and training nodes is the same split with one side empty.

CPU cores (the local launcher only; on Slurm, Slurm places cores): `split_cpus` is the same split for
the cores, the analogue of the seeds' inference/training GPU split on a CPU machine; the eval servers'
cores (`eval_cores`) stand apart from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipelinerl.config.ids import parse_cpu_ids, parse_gpu_ids  # noqa: F401 (the launcher's names for them)


def format_ids(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5": the list syntax parse_cpu_ids, taskset and vLLM's CPU binding read."""
    parts: list[str] = []
    for i in ids:
        if parts and parts[-1].split("-")[-1] == str(i - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{i}"
        else:
            parts.append(str(i))
    return ",".join(parts)


def split_evenly(ids: list[int], n: int) -> list[list[int]]:
    """n contiguous blocks of `ids`, sizes differing by at most one (the first ones larger)."""
    size, extra = divmod(len(ids), n)
    bounds = [i * size + min(i, extra) for i in range(n + 1)]
    return [ids[bounds[i]:bounds[i + 1]] for i in range(n)]


def server_gpu_groups(gpus: list[str], num_servers: int, tensor_parallel_size: int) -> list[list[str]]:
    """tensor_parallel_size contiguous GPUs per server, in order."""
    need = num_servers * tensor_parallel_size
    if need > len(gpus):
        raise ValueError(f"inference.num_servers={num_servers} x tensor_parallel_size={tensor_parallel_size} "
                         f"needs {need} GPUs; the servers have {len(gpus)} ({','.join(gpus) or 'none'})")
    return [gpus[i * tensor_parallel_size:(i + 1) * tensor_parallel_size] for i in range(num_servers)]


@dataclass(frozen=True)
class CpuPlacement:
    """CPU cores of the roles on this machine, applied as CPU affinity (inherited by every process a role
    starts). Servers and trainer own disjoint cores; the actor's cores may be shared."""

    servers: list[list[int]]  # per server slot (policy, then reference and reward; not eval): its cores
    trainer: list[int]  # shared by the trainer ranks (each gets len // ranks torch threads)
    actor: list[int] | None  # None: not pinned, it floats over every core (no core was left for it)

    def describe(self) -> list[str]:
        """One line per role, for --dry-run."""
        lines = [f"server{i}: CPU cores {format_ids(cores)}" for i, cores in enumerate(self.servers)]
        actor = f"CPU cores {format_ids(self.actor)}" if self.actor is not None else "every core (not pinned)"
        return lines + [f"trainer: CPU cores {format_ids(self.trainer)}", f"actor: {actor}"]


@dataclass(frozen=True)
class Placement:
    """Where the roles of one node run. None = on CPU (no CUDA_VISIBLE_DEVICES set)."""

    server_gpus: list[list[str]] | None  # per server slot: its GPU ids
    trainer_gpus: list[str] | None  # the trainer ranks' GPUs; rank r uses trainer_gpus[r] (LOCAL_RANK r)
    trainer_ranks: int  # trainer processes on this node
    cpus: CpuPlacement | None = None  # the roles' CPU cores (local launcher); None = not pinned
    eval_cpus: list[int] | None = None  # shared by the eval servers (launch.eval_cpus); None = not pinned

    def describe(self, servers: list[str]) -> list[str]:
        """One line per role, for --dry-run; `servers` names the server slots' roles in order."""
        lines = [f"{name}: GPUs {','.join(self.server_gpus[i])}" if self.server_gpus else f"{name}: CPU"
                 for i, name in enumerate(servers)]
        if self.eval_cpus is not None:
            lines.append(f"eval servers: CPU cores {format_ids(self.eval_cpus)} (shared)")
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


def split_cpus(machine: list[int], inference: str | None, training: str | None, actor: str | None,
               num_servers: int, tensor_parallel_size: int) -> CpuPlacement | None:
    """The cores of `machine` (those the launcher may use) split between the roles; None when no list is
    set (no pinning). A null list of the servers or the trainer takes the cores no other list names;
    servers split theirs into equal contiguous blocks, one per slot."""
    if inference is None and training is None:
        if actor is not None:
            raise ValueError("launch.actor_cpus is set without launch.inference_cpus / launch.training_cpus: "
                             "set those too (CPU placement splits the machine between all roles)")
        return None
    named = {"launch.inference_cpus": inference, "launch.training_cpus": training, "launch.actor_cpus": actor}
    lists = {key: machine_cores(machine, key, spec) for key, spec in named.items() if spec is not None}
    named_cores = {i for ids in lists.values() for i in ids}
    rest = [i for i in machine if i not in named_cores]
    serving = lists.get("launch.inference_cpus", rest)
    training_cores = lists.get("launch.training_cpus", rest)
    assert not set(serving) & set(training_cores), "LaunchConfig refuses overlapping inference/training cores"
    need = {"launch.inference_cpus": (serving, num_servers * tensor_parallel_size, "one per server and tensor-parallel "
                                      "worker, reference servers included"),
            "launch.training_cpus": (training_cores, 1, "the trainer's")}
    for key, (ids, least, why) in need.items():
        if len(ids) < least:
            given = format_ids(ids) or "none: the other lists name every core"
            raise ValueError(f"{key} gives {len(ids)} core(s) ({given}); it needs at least {least} ({why})")
    free = [i for i in machine if i not in serving and i not in training_cores]
    actor_cores = lists.get("launch.actor_cpus", free or None)
    return CpuPlacement(split_evenly(serving, num_servers), training_cores, actor_cores)


def machine_cores(machine: list[int], key: str, spec: str) -> list[int]:
    """The cores list `spec` (config key `key`) names, every one of them a core of `machine` (the launcher's)."""
    ids = parse_cpu_ids(spec)
    if missing := [i for i in ids if i not in machine]:
        raise ValueError(f"{key} = {spec} names core(s) {format_ids(missing)} that this launcher may not use; it has "
                         f"cores {format_ids(machine)}")
    return ids


def eval_cores(machine: list[int], spec: str | None, tensor_parallel_size: int) -> list[int] | None:
    """The cores of `machine` every eval server runs on (launch.eval_cpus `spec`), at least one per
    tensor-parallel worker; they may be any other role's too (an eval server mostly waits). None: not pinned."""
    if spec is None:
        return None
    ids = machine_cores(machine, "launch.eval_cpus", spec)
    if len(ids) < tensor_parallel_size:
        raise ValueError(f"launch.eval_cpus gives {len(ids)} core(s) ({format_ids(ids)}); it needs at least "
                         f"{tensor_parallel_size} (one per tensor-parallel worker of an eval server)")
    return ids
