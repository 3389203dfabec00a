"""The `servers` role of a Slurm job on one inference node (`pipelinerl slurm servers`): one
`pipelinerl serve` per server slot, each on its own GPUs, and task.openenv.servers OpenEnv environment servers
(`pipelinerl openenv-serve`, with task.openenv.serve; no GPU), supervised until SIGTERM or a failure past
launch.max_restarts: a server that dies, or stops answering /health once announced (launch/health.py), is
restarted on its GPUs and port, a policy or eval server from the latest checkpoint in the shared RUN_DIR
(launch/restarts.py; TensorBoard under RUN_DIR/tb/launch/<node>).
The job-level launcher (`launch/slurm.py`) runs this role as one srun step per server node, and runs a
node's step again when it ends (the agent past its budget, the step cancelled, the agent killed).

`node_placement` is where a node's GPUs go, for both sides: on separate inference and training nodes
each side takes every GPU of its own nodes; with launch.slurm.inference_nodes = 0 every node of the job
is split (placement.split_node) between the servers (launch.inference_gpus) and the trainer ranks
(launch.training_gpus). GPU ids there are positions in the GPUs Slurm gives the step
(CUDA_VISIBLE_DEVICES): the node's own ids 0..gpus_per_node-1 on whole (--exclusive) nodes.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

from pipelinerl.config import Config
from pipelinerl.launch.commands import (
    discovery_file,
    node_slots,
    openenv_server,
    server_command,
    server_env,
    side_server_kinds,
    threads_env,
)
from pipelinerl.launch.local import policy_restart
from pipelinerl.launch.placement import Placement, server_gpu_groups, split_node
from pipelinerl.launch.procs import Role, RoleFailed, Supervisor
from pipelinerl.rundir import POLICY_KINDS


def colocated(cfg: Config) -> bool:
    """Servers and trainer ranks share every node of the job (launch.slurm.inference_nodes = 0)."""
    return cfg.launch.slurm.inference_nodes == 0


def node_placement(cfg: Config) -> Placement:
    """GPU positions of one node's servers and trainer ranks (the same on every node of their side)."""
    s, launch, inf = cfg.launch.slurm, cfg.launch, cfg.inference
    gpus = s.gpus_per_node or 0
    if colocated(cfg):
        return split_node(gpus, launch.inference_gpus, launch.training_gpus, inf.num_servers,
                          inf.tensor_parallel_size, None)
    if launch.inference_gpus or launch.training_gpus:
        raise ValueError("launch.inference_gpus / launch.training_gpus split one node between servers and trainer; "
                         f"with launch.slurm.inference_nodes={s.inference_nodes} they have nodes of their own and use "
                         "every GPU there: unset both, or set launch.slurm.inference_nodes=0 to share the nodes")
    if gpus == 0:
        return Placement(None, None, 1)
    every = [str(i) for i in range(gpus)]
    return Placement(server_gpu_groups(every, inf.num_servers, inf.tensor_parallel_size), every, gpus)


def visible_gpus(placed: list[str], gpus_per_node: int, environ=os.environ) -> str:
    """CUDA_VISIBLE_DEVICES for GPU positions `placed`: the step's own ids at those positions."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(gpus_per_node)]
    if max(int(i) for i in placed) >= len(ids):
        raise ValueError(f"GPUs {','.join(placed)} are placed but this step sees {len(ids)} GPU(s) "
                         f"(CUDA_VISIBLE_DEVICES={visible}); ask for launch.slurm.gpus_per_node={gpus_per_node} "
                         "on whole nodes")
    return ",".join(ids[int(i)] for i in placed)


def node_server_roles(cfg: Config, config_path: str, model: str, version: int, node: str,
                      side: bool) -> list[Role]:
    """One `pipelinerl serve` per server slot i of an inference node, each on its own GPUs: on the node that
    hosts them (`side`), the first slots serve the reference and reward models and then the eval servers
    (commands.node_slots), the others the policy; policy and eval servers from `model` at `version`, and after a
    restart from the latest checkpoint (ports: commands.py). Then the node's OpenEnv environment servers
    (cfg.task.openenv_servers_started of them), restarted with the same command."""
    gpus, logs = node_placement(cfg).server_gpus, Path(cfg.run_dir) / "logs"
    roles = []
    for i, (kind, index) in enumerate(node_slots(cfg, side)):
        env = server_env(cfg)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible_gpus(gpus[i], cfg.launch.slurm.gpus_per_node)
        name, argv = server_command(cfg, config_path, kind, index, model, version)
        restart_argv = policy_restart(cfg, config_path, index, node, kind) if kind in POLICY_KINDS else None
        roles.append(Role(name, argv, logs / f"{node}_{name}.log", env, restart_argv=restart_argv,
                          discovery=discovery_file(cfg, index, kind)))
    for index in range(cfg.task.openenv_servers_started):
        name, argv = openenv_server(cfg, config_path, index)
        roles.append(Role(name, argv, logs / f"{node}_{name}.log", threads_env(cfg),
                          discovery=discovery_file(cfg, index, "openenv")))
    return roles


def run_node_servers(cfg: Config, config_path: str, model: str, version: int, side_node: str | None) -> None:
    """The `servers` role on one inference node: its `node_server_roles` (reference, reward and eval servers only
    on `side_node`), supervised until SIGTERM or the first failure."""
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    side = node == side_node
    kinds = side_server_kinds(cfg) if side else []
    sup = Supervisor.from_config(cfg, f"launch/{node}")
    envs = f", {cfg.task.openenv_servers_started} OpenEnv server(s)" if cfg.task.openenv_servers_started else ""
    print(f"pipelinerl slurm servers on {node}: {cfg.inference.num_servers} server(s), {len(kinds)} of them not "
          f"policy servers ({', '.join(kinds) or 'none'}), the policy from {model} at version {version}{envs}",
          file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the launcher's normal way to stop this role
    try:
        for role in node_server_roles(cfg, config_path, model, version, node, side):
            sup.start(role)
        while True:
            sup.check()
            time.sleep(1.0)
    except RoleFailed as err:
        print(f"pipelinerl slurm servers on {node}: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        sup.stop_all()
