"""The `servers` role of a Slurm job on one inference node (`pipelinerl slurm servers`): one
`pipelinerl serve` per server slot, each on its own GPUs, supervised until SIGTERM or the first failure.
The job-level launcher that starts this role on every inference node is `launch/slurm.py`."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

from pipelinerl.config import Config
from pipelinerl.launch.local import reference_server_count
from pipelinerl.launch.procs import Role, RoleFailed, Supervisor


def _node_gpus(cfg: Config) -> list[list[str]] | None:
    """GPU ids per server on this node (tensor_parallel_size each), or None on CPU."""
    if cfg.launch.slurm.gpus_per_node is None:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(cfg.launch.slurm.gpus_per_node)]
    tp, n = cfg.inference.tensor_parallel_size, cfg.inference.num_servers
    if n * tp > len(gpus):
        raise ValueError(f"inference.num_servers={n} x tensor_parallel_size={tp} needs {n * tp} GPUs per node; "
                         f"this node has {len(gpus)}")
    return [gpus[i * tp:(i + 1) * tp] for i in range(n)]


def node_server_roles(cfg: Config, config_path: str, model: str, version: int, node: str,
                      references: int) -> list[Role]:
    """One `pipelinerl serve` per server slot i of an inference node, each on its own GPUs: the first
    `references` slots serve the reference model (port base_port + num_servers + i), the others the
    policy from `model` at `version` (port base_port + i)."""
    inf, gpus = cfg.inference, _node_gpus(cfg)
    threads = {} if cfg.launch.torch_threads is None else {"OMP_NUM_THREADS": str(cfg.launch.torch_threads)}
    serve = [sys.executable, "-m", "pipelinerl.cli", "serve", "--config", config_path]
    roles = []
    for i in range(inf.num_servers):
        env = dict(threads) if gpus is None else {**threads, "CUDA_VISIBLE_DEVICES": ",".join(gpus[i])}
        if i < references:
            name, argv = f"reference{i}", serve + ["--reference", "--port", str(inf.base_port + inf.num_servers + i)]
        else:
            # Served under the base model's name, which the actor asks for, also when `model` is a checkpoint.
            name, argv = f"server{i}", serve + ["--model", model, "--port", str(inf.base_port + i), "--version",
                                                str(version), f"inference.engine_args.served_model_name={cfg.model.path}"]
        roles.append(Role(name, argv, Path(cfg.run_dir) / "logs" / f"{node}_{name}.log", env))
    return roles


def run_node_servers(cfg: Config, config_path: str, model: str, version: int, reference_node: str | None) -> None:
    """The `servers` role on one inference node: its `node_server_roles` (reference servers only on
    `reference_node`), supervised until SIGTERM or the first failure."""
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    references = reference_server_count(cfg) if node == reference_node else 0
    sup = Supervisor()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the launcher's normal way to stop this role
    try:
        for role in node_server_roles(cfg, config_path, model, version, node, references):
            sup.start(role)
        while True:
            sup.check()
            time.sleep(1.0)
    except RoleFailed as err:
        print(f"pipelinerl slurm servers on {node}: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        sup.stop_all()
