"""Every role's command line, port and thread environment: one home for both launchers (`pipelinerl run`
on this machine, the Slurm node agent in slurm_node.py and the job launcher in slurm.py).

Server slots and ports: policy server i listens on inference.base_port + i, reference server i on
inference.base_port + inference.num_servers + i (after every policy slot), reward server i on
inference.base_port + inference.num_servers + inference.reference_servers + i: no two kinds collide.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipelinerl.config import Config
from pipelinerl.rundir import (
    REFERENCE_SERVERS_DIR,
    REWARD_SERVERS_DIR,
    SERVERS_DIR,
    advertised_host,
    bind_host,
    server_file,
)


def cli(python: str = sys.executable) -> list[str]:
    """The `pipelinerl` command as this Python runs it (no console script needed on the nodes)."""
    return [python, "-m", "pipelinerl.cli"]


def threads_env(cfg: Config, cores: int | None = None) -> dict[str, str]:
    """The thread environment of a role: OMP_NUM_THREADS = `cores`, a pinned role's cores per process, else
    launch.torch_threads (null: torch's default)."""
    threads = cfg.launch.torch_threads if cores is None else cores
    return {} if threads is None else {"OMP_NUM_THREADS": str(threads)}


def server_env(cfg: Config, cores: list[int] | None = None) -> dict[str, str]:
    """A server's thread environment. On its own `cores`: vLLM-CPU binds each tensor-parallel worker's
    OpenMP threads to one of the `|`-separated lists of VLLM_CPU_OMP_THREADS_BIND, and sets the worker's
    OMP_NUM_THREADS to its length; explicit lists keep every worker inside the server's cores. Unpinned:
    `nobind`, so the OS places its threads. vLLM's default, `auto`, gives worker k the cores of NUMA node k
    less a few it reserves: every server of a one-node machine lands on the same cores (all on core 0 of 2).
    GPU builds ignore the variable."""
    from pipelinerl.launch.placement import format_ids, split_evenly

    if not cores:
        return {**threads_env(cfg), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    groups = split_evenly(cores, cfg.inference.tensor_parallel_size)
    return {**threads_env(cfg, len(groups[0])),
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(format_ids(group) for group in groups)}


def reference_server_count(cfg: Config) -> int:
    """How many reference servers the run starts: inference.reference_servers when the RL objective needs
    reference log-probs, else none."""
    return cfg.inference.reference_servers if cfg.rl.needs_reference_logprobs else 0


# The servers that never take weight updates, in slot order after the policy servers: kind -> discovery folder.
FROZEN_FOLDERS = {"reference": REFERENCE_SERVERS_DIR, "reward": REWARD_SERVERS_DIR}


def frozen_server_counts(cfg: Config) -> dict[str, int]:
    """How many servers of each frozen kind the run starts (FROZEN_FOLDERS' order)."""
    return {"reference": reference_server_count(cfg), "reward": cfg.reward.servers_started}


def frozen_server_kinds(cfg: Config) -> list[str]:
    """The kind of each frozen server the run starts, in slot order: reference servers, then reward servers."""
    return [kind for kind, n in frozen_server_counts(cfg).items() for _ in range(n)]


def node_slots(cfg: Config, frozen: bool) -> list[tuple[str, int]]:
    """(kind, index) of each server slot of a Slurm inference node: on the node that hosts them (`frozen`), the
    first slots serve the frozen kinds (reference servers, then reward servers; index counted within the kind);
    every other slot i serves the policy (index i)."""
    kinds = frozen_server_kinds(cfg) if frozen else []
    slots = []
    for i in range(cfg.inference.num_servers):
        kind = kinds[i] if i < len(kinds) else "policy"
        slots.append((kind, kinds[:i].count(kind) if kind != "policy" else i))
    return slots


def slot_names(cfg: Config, frozen: bool) -> list[str]:
    """The role name of each server slot of a Slurm inference node (node_slots): server<i>, reference<j>, reward<j>."""
    return [f"server{index}" if kind == "policy" else f"{kind}{index}" for kind, index in node_slots(cfg, frozen)]


def policy_server(cfg: Config, config_path: str, i: int, model: str, version: int) -> tuple[str, list[str]]:
    """(name, argv) of policy server slot i, serving `model` (the base model or a checkpoint's HF folder)
    at policy `version`. Served under the base model's name, whichever folder it loads."""
    argv = [*cli(), "serve", str(config_path), "--model", model, "--port", str(server_port(cfg, i)),
            "--version", str(version), f"inference.engine_args.served_model_name={cfg.model.path}"]
    return f"server{i}", argv


def frozen_server(cfg: Config, config_path: str, kind: str, i: int) -> tuple[str, list[str]]:
    """(name, argv) of reference server i (the run's initial model) or reward server i (reward.model_path)."""
    return f"{kind}{i}", [*cli(), "serve", str(config_path), f"--{kind}", "--port", str(server_port(cfg, i, kind))]


def server_port(cfg: Config, i: int, kind: str = "policy") -> int:
    """The port of policy server slot i, or of reference / reward server i."""
    inf = cfg.inference
    offset = {"policy": 0, "reference": inf.num_servers, "reward": inf.num_servers + inf.reference_servers}[kind]
    return inf.base_port + offset + i


def discovery_file(cfg: Config, i: int, kind: str = "policy") -> Path:
    """Where policy server i (or reference / reward server i) on this host announces itself once healthy."""
    folder = FROZEN_FOLDERS.get(kind, SERVERS_DIR)
    host = advertised_host(bind_host(cfg.inference.host))
    return server_file(cfg.run_dir, host, server_port(cfg, i, kind), folder)
