"""Slurm launch: the sbatch scripts' rendered srun lines and GPU placement (fast), then real jobs on a
throw-away multi-host virtual cluster on this machine (tests/slurm/start_cluster.sh, slow): every node has
its own network namespace, address, fully qualified hostname (not Slurm's node name, and resolving to
127.0.1.1 on the node itself, as on Debian images) and /dev/shm, and mounts the run directories over the
network (sshfs with caching, as NFS). On it: the flagship shape (2 servers, 2 trainer ranks on 2 nodes, the
actor) as a heterogeneous job in pipeline mode with a killed servers step and a requeue mid-run that must
neither lose nor repeat a sample, the same in conventional mode, and a submitit sweep.

The cluster runs as root with state under /tmp; its daemons, mounts and namespaces go when the session ends.
"""

import dataclasses
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipelinerl.config import StreamsConfig, load_config
from pipelinerl.launch import slurm
from pipelinerl.launch.slurm import check_config, dry_run_allocation, plan_roles, render
from pipelinerl.launch.slurm_node import node_placement, node_server_roles
from pipelinerl.metrics import read_token_stats
from pipelinerl.rundir import list_servers
from pipelinerl.streams import StreamReader, StreamTimeout
from pipelinerl.trainer.checkpoints import latest_checkpoint

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = {"run_7b.sh": "configs/qwen7b_orz.yaml", "run_32b.sh": "configs/qwen32b_orz.yaml",
           "run_tiny.sh": "configs/tiny_cpu.yaml", "run_tiny_flagship.sh": "configs/tiny_cpu.yaml",
           "run_7b_one_node.sh": "configs/qwen7b_orz.yaml", "run_30b_a3b.sh": "configs/qwen3_30b_a3b.yaml"}
CLUSTER_STATE = "/tmp/pipelinerl-vcluster-tests"
SHARED = Path(CLUSTER_STATE) / "shared"  # every node's network mount of it; here, the file server's own folder
SUBNET = "10.214.0"  # the cluster's bridge: node vnI is SUBNET.(10+I)
SAMPLES_PER_STEP = 32


def _tiny_overrides(run_dir: Path, model_dir: Path, max_steps: int, port: int = 18400) -> list[str]:
    """A shortened tiny run on ports of this test module's range (18400-18499)."""
    return [f"run_dir={run_dir}", f"model.path={model_dir}", "model.build_tiny_if_missing=false",
            f"trainer.max_steps={max_steps}", f"trainer.samples_per_step={SAMPLES_PER_STEP}",
            "actor.sampling.max_new_tokens=8", "actor.eval_every_steps=0", "actor.max_groups_in_flight=8",
            "inference.max_model_len=64", "streams.segment_max_seconds=0.5", "checkpoints.every_steps=null",
            "inference.startup_timeout_s=900",  # two vLLM servers starting on a loaded 2-core machine: minutes
            "inference.engine_args.enforce_eager=true",  # no torch.compile warm-up: 30-60 s less per server start
            f"inference.base_port={port}", f"trainer.broadcast_port={port + 10}",
            f"launch.slurm.master_port={port + 20}"]


# -- rendered commands and script headers (no cluster) -----------------------------------------------------

def _script_config(script: str, *overrides: str):
    """The config a script runs: its default config file with the script's own --shape overrides."""
    text = (REPO / "slurm" / script).read_text().replace("\\\n", "")
    shape = re.search(r'--shape "([^"]*)"', text)
    return load_config(REPO / SCRIPTS[script], [*(shape.group(1).split() if shape else []), *overrides])


def _dry_run(script: str) -> dict[str, tuple[dict[str, str], list[str]]]:
    """role -> (environment, srun argv) as `bash slurm/<script> --dry-run` prints them."""
    out = subprocess.run(["bash", f"slurm/{script}", "--dry-run"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PIPELINERL_PYTHON=sys.executable), check=True).stdout
    roles, lines = {}, out.splitlines()
    for header, command in itertools.pairwise(lines):
        if found := re.match(r"# (\S+) \(log ", header):
            argv = shlex.split(command)
            env = dict(a.split("=", 1) for a in argv[:argv.index("srun")])
            roles[found.group(1)] = (env, argv[argv.index("srun"):])
    assert {"trainer", "actor"} < set(roles), out
    assert all(name.startswith("servers@") for name in set(roles) - {"trainer", "actor"}), out
    return roles


def _rank_command(trainer: list[str]) -> str:
    """The per-task shell command of the trainer step: Slurm's task variables -> torch.distributed's."""
    assert trainer[-3:-1] == ["bash", "-c"]
    command = trainer[-1]
    assert command.startswith('RANK="$SLURM_PROCID" WORLD_SIZE="$SLURM_NTASKS" LOCAL_RANK="$SLURM_LOCALID" exec ')
    return command


def test_7b_script_renders_one_inference_and_one_training_node():
    roles = _dry_run("run_7b.sh")
    servers = roles["servers@inference0"][1]
    assert servers[:7] == ["srun", "--het-group=0", "--nodes=1", "--nodelist=inference0", "--ntasks=1",
                           "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert "--gpus-per-node=8" in servers  # the node's servers agent splits them, one GPU per server
    assert servers[-7:] == ["slurm", "servers", "runs/qwen7b_orz/config.yaml", "--model", "/models/Qwen2.5-7B",
                            "--version", "0"]
    env, trainer = roles["trainer"]
    assert trainer[1:6] == ["--het-group=1", "--nodes=1", "--nodelist=training0", "--ntasks=8", "--ntasks-per-node=8"]
    assert "--gpus-per-node=8" in trainer and "--overlap" in trainer
    assert _rank_command(trainer).endswith("-m pipelinerl.cli train runs/qwen7b_orz/config.yaml")
    # One log per rank (srun's %t), appended across requeues.
    assert "--output=runs/qwen7b_orz/logs/trainer_rank%t.log" in trainer and "--open-mode=append" in trainer
    assert env["MASTER_ADDR"] == "training0" and env["MASTER_PORT"].isdigit()
    actor = roles["actor"][1]
    assert actor[1:6] == ["--het-group=1", "--nodes=1", "--nodelist=training0", "--ntasks=1", "--ntasks-per-node=1"]
    assert "--overlap" in actor and not any(a.startswith("--gpus") for a in actor)


def test_32b_script_renders_two_inference_and_two_training_nodes():
    roles = _dry_run("run_32b.sh")
    for node in ("inference0", "inference1"):  # one step per node: each runs again alone when it dies
        assert roles[f"servers@{node}"][1][1:6] == ["--het-group=0", "--nodes=1", f"--nodelist={node}", "--ntasks=1",
                                                    "--ntasks-per-node=1"]
    env, trainer = roles["trainer"]
    assert trainer[1:6] == ["--het-group=1", "--nodes=2", "--nodelist=training0,training1", "--ntasks=16",
                            "--ntasks-per-node=8"]
    assert "--gpus-per-node=8" in trainer and env["MASTER_ADDR"] == "training0"
    _rank_command(trainer)
    assert roles["actor"][1][1:4] == ["--het-group=1", "--nodes=1", "--nodelist=training0"]
    # Each inference node splits its 8 GPUs into two tensor-parallel groups of 4, one server each.
    cfg = load_config(REPO / "configs/qwen32b_orz.yaml")
    assert node_placement(cfg).server_gpus == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]


def test_30b_a3b_script_renders_four_tp2_servers_and_one_training_node():
    roles = _dry_run("run_30b_a3b.sh")
    assert roles["servers@inference0"][1][1:4] == ["--het-group=0", "--nodes=1", "--nodelist=inference0"]
    env, trainer = roles["trainer"]
    assert trainer[1:6] == ["--het-group=1", "--nodes=1", "--nodelist=training0", "--ntasks=8", "--ntasks-per-node=8"]
    assert _rank_command(trainer).endswith("-m pipelinerl.cli train runs/qwen3_30b_a3b/config.yaml")
    cfg = load_config(REPO / "configs/qwen3_30b_a3b.yaml")
    assert node_placement(cfg).server_gpus == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
    check_config(cfg)


def test_flagship_script_renders_two_servers_and_two_training_nodes():
    roles = _dry_run("run_tiny_flagship.sh")
    assert roles["servers@inference0"][1][1:4] == ["--het-group=0", "--nodes=1", "--nodelist=inference0"]
    assert roles["trainer"][1][1:6] == ["--het-group=1", "--nodes=2", "--nodelist=training0,training1",
                                        "--ntasks=2", "--ntasks-per-node=1"]
    flagship = _script_config("run_tiny_flagship.sh")
    assert [r.name for r in node_server_roles(flagship, "c.yaml", "m", 0, "n1", False)] == ["server0", "server1"]


def _rank_environment(trainer: list[str], visible: str | None, local_rank: int) -> dict[str, str]:
    """Run the trainer step's per-task shell command with `env` in place of the trainer: what a rank gets."""
    command = re.sub(r"exec .*$", "exec env", trainer[-1])
    env = {"PATH": os.environ["PATH"], "SLURM_PROCID": str(local_rank), "SLURM_NTASKS": "4",
           "SLURM_LOCALID": str(local_rank), **({} if visible is None else {"CUDA_VISIBLE_DEVICES": visible})}
    out = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, check=True, timeout=30)
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


@pytest.mark.parametrize("visible", [None, "0,1,2,3,4,5,6,7", "8,9,10,11,12,13,14,15"])
def test_one_node_script_gives_servers_and_ranks_disjoint_gpus(visible, monkeypatch):
    """run_7b_one_node.sh: 4 servers on GPUs 0-3 and 4 trainer ranks on 4-7 of one node, whatever ids
    Slurm gives the step (positions in its CUDA_VISIBLE_DEVICES)."""
    roles = _dry_run("run_7b_one_node.sh")
    cfg = _script_config("run_7b_one_node.sh")
    servers, (trainer_env, trainer), actor = roles["servers@node0"][1], roles["trainer"], roles["actor"][1]
    assert "--het-group=0" not in servers and servers[1:3] == ["--nodes=1", "--nodelist=node0"]
    assert "--overlap" in servers  # a servers step run again shares the node with the trainer's step
    assert "--gpus-per-node=8" in servers and "--gpus-per-node=8" in trainer and "--overlap" in trainer
    assert trainer[1:5] == ["--nodes=1", "--nodelist=node0", "--ntasks=4", "--ntasks-per-node=4"]
    assert actor[1:3] == ["--nodes=1", "--nodelist=node0"] and "--overlap" in actor
    assert trainer_env["MASTER_ADDR"] == "node0"
    ids = (visible or "0,1,2,3,4,5,6,7").split(",")
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    server_gpus = [r.env["CUDA_VISIBLE_DEVICES"] for r in node_server_roles(cfg, "c.yaml", "m", 0, "node0", False)]
    assert server_gpus == ids[:4]
    for rank in range(4):
        env = _rank_environment(trainer, visible, rank)
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(ids[4:]) and env["LOCAL_RANK"] == str(rank)
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(rank), "4")
    assert not set(server_gpus) & set(ids[4:])  # disjoint
    out = render(cfg, dry_run_allocation(cfg))
    assert "#   server3: GPUs 3\n#   trainer: 4 rank(s) on GPUs 4,5,6,7" in out


def test_colocated_nodes_each_split_the_same_way():
    cfg = _script_config("run_7b_one_node.sh", "launch.slurm.training_nodes=2", "trainer.num_gpus=8",
                         "inference.num_servers=2", "inference.tensor_parallel_size=2")
    check_config(cfg)
    assert node_placement(cfg).server_gpus == [["0", "1"], ["2", "3"]]
    roles = plan_roles(cfg, dry_run_allocation(cfg), Path("c.yaml"))
    for node in ("node0", "node1"):
        assert roles[f"servers@{node}"].argv[1:5] == ["--nodes=1", f"--nodelist={node}", "--ntasks=1",
                                                     "--ntasks-per-node=1"]
    assert roles["trainer"].argv[1:5] == ["--nodes=2", "--nodelist=node0,node1", "--ntasks=8", "--ntasks-per-node=4"]
    assert roles["actor"].argv[1:3] == ["--nodes=1", "--nodelist=node0"]


def test_colocated_job_serves_on_every_node(monkeypatch):
    """allocation_from_env of a plain (not het) job with inference_nodes = 0: every host serves and trains."""
    monkeypatch.setattr(slurm, "hostnames", lambda nodelist: ["gpu7", "gpu8"])
    monkeypatch.setattr(slurm, "node_field", lambda node, name: {"NodeAddr": f"10.0.0.{node[-1]}"}[name])
    cfg = _script_config("run_7b_one_node.sh", "launch.slurm.training_nodes=2", "trainer.num_gpus=8")
    alloc = slurm.allocation_from_env(cfg, {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[7-8]"})
    assert (alloc.inference, alloc.training, alloc.master_addr, alloc.het) == (["gpu7", "gpu8"], ["gpu7", "gpu8"],
                                                                               "10.0.0.7", False)
    assert alloc.addresses == {"gpu7": "10.0.0.7", "gpu8": "10.0.0.8"}
    with pytest.raises(ValueError, match="the job has 2 training node.s. but launch.slurm.training_nodes=1"):
        slurm.allocation_from_env(_script_config("run_7b_one_node.sh"),
                                  {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "x"})


@pytest.mark.parametrize(("overrides", "message"), [
    (["launch.inference_gpus=0-4"], "share GPU.s. 4; servers and trainer ranks need disjoint GPUs"),
    (["launch.training_gpus=4-8"], "launch.training_gpus = 4,5,6,7,8 but this node has GPUs 0-7"),
    (["inference.num_servers=5"], "inference.num_servers=5 x tensor_parallel_size=1 needs 5 GPUs"),
    (["trainer.num_gpus=8"], "trainer.num_gpus=8 but launch.slurm.training_nodes x launch.training_gpus gives 4"),
    (["launch.slurm.inference_nodes=1"], "with launch.slurm.inference_nodes=1 they have nodes of their own"),
])
def test_bad_one_node_splits_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_config(_script_config("run_7b_one_node.sh", *overrides))


def test_trainer_ranks_must_match_the_training_gpus():
    cfg = load_config(REPO / "configs/qwen7b_orz.yaml", ["trainer.num_gpus=16"])
    with pytest.raises(ValueError, match="trainer.num_gpus=16 .* gives 8 trainer ranks"):
        check_config(cfg)


def test_reference_servers_take_the_first_slots_of_the_first_inference_node(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    plain = load_config(REPO / "configs/qwen32b_orz.yaml")
    cfg = load_config(REPO / "configs/qwen32b_orz.yaml", ["rl.kl_coef=0.05"])
    check_config(cfg)
    path = Path(cfg.run_dir) / "config.yaml"
    assert "--side-node" not in plan_roles(plain, dry_run_allocation(plain), path)["servers@inference0"].argv
    for node in ("inference0", "inference1"):
        assert plan_roles(cfg, dry_run_allocation(cfg), path)[f"servers@{node}"].argv[-2:] == ["--side-node",
                                                                                              "inference0"]
    base, n = cfg.inference.base_port, cfg.inference.num_servers
    reference, policy = node_server_roles(cfg, str(path), "/ckpt/hf", 7, "inference0", side=True)
    assert (reference.name, reference.env["CUDA_VISIBLE_DEVICES"]) == ("reference0", "0,1,2,3")
    assert reference.argv[reference.argv.index("serve") + 1:] == [str(path), "--reference", "--port",
                                                                  str(base + n)]
    assert (policy.name, policy.env["CUDA_VISIBLE_DEVICES"]) == ("server1", "4,5,6,7")
    assert policy.argv[policy.argv.index("--model"):][:6] == ["--model", "/ckpt/hf", "--port", str(base + 1),
                                                              "--version", "7"]
    assert [r.name for r in node_server_roles(cfg, str(path), "/ckpt/hf", 7, "inference1", side=False)] == [
        "server0", "server1"]


def test_eval_servers_take_slots_of_the_first_inference_node_after_the_frozen_ones(monkeypatch, tmp_path):
    """inference.eval_servers on Slurm: server slots of the first inference node after the reference (and reward)
    servers, each a policy server with --eval on its own port, announced in RUN_DIR/eval_servers and restarted by
    its node's agent from the latest checkpoint; the other node serves the policy only."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    monkeypatch.setenv("PIPELINERL_ADVERTISE_HOST", "gpu0")  # what the launcher gives the first node's agent
    run_dir = tmp_path / "run"
    cfg = load_config(REPO / "configs/qwen32b_orz.yaml", [f"run_dir={run_dir}", "rl.kl_coef=0.05",
                                                          "inference.eval_servers=1"])
    check_config(cfg)
    path, base = str(run_dir / "config.yaml"), cfg.inference.base_port
    reference, evaluator = node_server_roles(cfg, path, "/ckpt/hf", 7, "inference0", side=True)
    assert (evaluator.name, evaluator.env["CUDA_VISIBLE_DEVICES"]) == ("eval0", "4,5,6,7")
    assert evaluator.argv[evaluator.argv.index("serve") + 1:] == [
        path, "--eval", "--model", "/ckpt/hf", "--port", str(base + 3), "--version", "7",
        f"inference.engine_args.served_model_name={cfg.model.path}"]
    assert evaluator.discovery == run_dir / "eval_servers" / f"gpu0_{base + 3}"
    assert reference.restart_argv is None and evaluator.log_path == run_dir / "logs" / "inference0_eval0.log"
    (run_dir / "checkpoints" / "step_00000009" / "hf").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000009" / "meta.json").write_text(json.dumps({"step": 9, "version": 9}))
    restarted = evaluator.restart_argv()
    assert restarted[restarted.index("--model") + 1] == str(run_dir / "serving" / "inference0_eval0")
    assert restarted[restarted.index("--version") + 1] == "9"
    assert [r.name for r in node_server_roles(cfg, path, "/ckpt/hf", 7, "inference1", side=False)] == [
        "server0", "server1"]
    alloc = dataclasses.replace(dry_run_allocation(cfg), addresses={"inference0": "gpu0", "inference1": "gpu1"})
    roles = plan_roles(cfg, alloc, Path(path))
    assert roles["servers@inference0"].discovery.paths == (run_dir / "reference_servers" / f"gpu0_{base + 2}",
                                                           run_dir / "eval_servers" / f"gpu0_{base + 3}")
    assert roles["servers@inference1"].argv[-2:] == ["--side-node", "inference0"]
    assert "#   eval0: GPUs 4,5,6,7" in render(cfg, alloc).splitlines()
    only_eval = load_config(REPO / "configs/qwen32b_orz.yaml", ["inference.eval_servers=1"])
    assert plan_roles(only_eval, dry_run_allocation(only_eval), Path(path))["servers@inference0"].argv[-2:] == [
        "--side-node", "inference0"]  # a side node with no frozen server: eval servers need it too


def test_each_server_node_is_a_step_run_again_from_the_latest_checkpoint(tmp_path):
    """servers@NODE: restartable, its restart command computed then (the latest complete checkpoint at its
    version, nothing else changed), and the discovery files of that node's servers (as the node names
    its servers advertise: its NodeAddr under a wildcard bind address, whatever the node calls itself) to remove at
    the restart; the agent's environment names that address."""
    run_dir = tmp_path / "run"
    cfg = load_config(REPO / "configs/qwen32b_orz.yaml", [f"run_dir={run_dir}", "rl.kl_coef=0.05"])
    assert cfg.inference.host == "0.0.0.0"
    alloc = dataclasses.replace(dry_run_allocation(cfg), addresses={"inference0": "gpu0", "inference1": "gpu1"})
    roles = plan_roles(cfg, alloc, Path("c.yaml"))
    first, second = roles["servers@inference0"], roles["servers@inference1"]
    assert first.restartable and second.restartable and first.log_path == run_dir / "logs" / "servers@inference0.log"
    assert (first.env["PIPELINERL_ADVERTISE_HOST"], second.env["PIPELINERL_ADVERTISE_HOST"]) == ("gpu0", "gpu1")
    checkpoint = run_dir / "checkpoints" / "step_00000007"
    (checkpoint / "hf").mkdir(parents=True)
    (checkpoint / "meta.json").write_text(json.dumps({"step": 7, "version": 7}))
    (run_dir / "checkpoints" / "step_00000009.tmp").mkdir()  # incomplete: never served
    argv = second.restart_argv()
    changed = [(old, new) for old, new in zip(second.argv, argv) if old != new]
    pinned = run_dir / "serving" / "servers@inference1"  # local.serving_weights: the trainer may rotate it away
    assert len(argv) == len(second.argv) and changed == [(cfg.model.path, str(pinned)), ("0", "7")]
    base = cfg.inference.base_port
    assert first.discovery.paths == (run_dir / "reference_servers" / f"gpu0_{base + 2}",
                                     run_dir / "servers" / f"gpu0_{base + 1}")
    assert second.discovery.paths == (run_dir / "servers" / f"gpu1_{base}", run_dir / "servers" / f"gpu1_{base + 1}")
    for path in second.discovery.paths[:1]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("http://gpu1\n")
    assert not second.discovery.exists()  # up again once every server of the node is back
    second.discovery.unlink(missing_ok=True)
    assert not any(p.exists() for p in second.discovery.paths)
    bound = load_config(REPO / "configs/qwen32b_orz.yaml", [f"run_dir={run_dir}", "inference.host=10.0.0.5"])
    assert plan_roles(bound, alloc, Path("c.yaml"))["servers@inference1"].discovery.paths[0] == (
        run_dir / "servers" / f"10.0.0.5_{base}")  # a server bound to an address advertises that address


def test_servers_bind_every_interface_on_slurm_and_loopback_is_refused_across_hosts(tmp_path):
    """inference.host null: 0.0.0.0 in the job's config (the actor and trainer reach the servers from other
    nodes); a loopback address is refused when a server node has another address than the first training node,
    and kept when every node is one host (as on a one-host test cluster)."""
    cfg = _script_config("run_tiny_flagship.sh", f"run_dir={tmp_path}")
    assert cfg.inference.host is None
    alloc = dataclasses.replace(dry_run_allocation(cfg), master_addr="10.0.0.2", addresses={"inference0": "10.0.0.1"})
    assert slurm.bound_for_slurm(cfg, alloc).inference.host == "0.0.0.0"
    for host in ("127.0.0.1", "localhost", "::1"):
        looped = dataclasses.replace(cfg, inference=dataclasses.replace(cfg.inference, host=host))
        with pytest.raises(ValueError, match=rf"inference.host={host} is a loopback address, but the servers on "
                                             r"inference0 are reached from training0: set inference.host=0.0.0.0"):
            slurm.bound_for_slurm(looped, alloc)
        one_host = dataclasses.replace(alloc, addresses={"inference0": "10.0.0.2"})
        assert slurm.bound_for_slurm(looped, one_host).inference.host == host
    bound = dataclasses.replace(cfg, inference=dataclasses.replace(cfg.inference, host="10.0.0.1"))
    assert slurm.bound_for_slurm(bound, alloc) is bound


def test_network_interface_reaches_every_role_unless_the_environment_names_one(tmp_path, monkeypatch):
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    cfg = _script_config("run_tiny_flagship.sh", f"run_dir={tmp_path}", "launch.network_interface=ib0")
    roles = plan_roles(cfg, dry_run_allocation(cfg), Path("c.yaml"))
    for role in roles.values():
        assert (role.env["GLOO_SOCKET_IFNAME"], role.env["NCCL_SOCKET_IFNAME"]) == ("ib0", "ib0"), role.name
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "=mlx5_0")
    roles = plan_roles(cfg, dry_run_allocation(cfg), Path("c.yaml"))
    assert all("NCCL_SOCKET_IFNAME" not in role.env and role.env["GLOO_SOCKET_IFNAME"] == "ib0"
               for role in roles.values())
    unset = _script_config("run_tiny_flagship.sh", f"run_dir={tmp_path}")
    assert not any("GLOO_SOCKET_IFNAME" in role.env for role in plan_roles(unset, dry_run_allocation(unset),
                                                                          Path("c.yaml")).values())


def test_reference_servers_must_fit_the_first_node_and_leave_a_policy_server():
    with pytest.raises(ValueError, match="take all 1 server slots .* and leave no policy server"):
        check_config(load_config(REPO / "configs/tiny_cpu.yaml", ["rl.kl_coef=0.1"]))
    check_config(load_config(REPO / "configs/tiny_cpu.yaml", ["rl.kl_coef=0.1", "inference.num_servers=2"]))
    with pytest.raises(ValueError, match="which has inference.num_servers=8"):
        check_config(load_config(REPO / "configs/qwen7b_orz.yaml", ["rl.kl_coef=0.1", "inference.reference_servers=9"]))
    # eval servers take slots too
    with pytest.raises(ValueError, match="2 reference, reward and eval servers would take all 2 server slots"):
        check_config(load_config(REPO / "configs/tiny_cpu.yaml", ["rl.kl_coef=0.1", "inference.num_servers=2",
                                                                  "inference.eval_servers=1"]))
    with pytest.raises(ValueError, match=r"9 reference, reward and eval servers \(reference, eval, eval, "):
        check_config(load_config(REPO / "configs/qwen7b_orz.yaml", ["rl.kl_coef=0.1", "inference.eval_servers=8"]))


# -- real jobs on the local cluster (slow) ------------------------------------------------------------------

def test_a_query_that_died_of_sigpipe_is_asked_again_and_an_action_runs_once(tmp_path, monkeypatch):
    """Fake clients that die of SIGPIPE on their first call (as squeue did under load when its controller
    dropped the connection): squeue answers on its second call; scancel is not run again."""
    for name in ("squeue", "scancel"):
        client = tmp_path / name
        client.write_text(f"#!/bin/bash\necho call >> {tmp_path}/{name}.calls\n"
                          f"[ $(wc -l < {tmp_path}/{name}.calls) -gt 1 ] || kill -PIPE $$\necho 42\n")
        client.chmod(0o755)
    monkeypatch.setattr(slurm.time, "sleep", lambda s: None)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")
    out = slurm.slurm_command("squeue", "-h", "-j", "42", env=env)
    assert (out.returncode, out.stdout) == (0, "42\n")
    assert (tmp_path / "squeue.calls").read_text().count("call") == 2
    assert slurm.slurm_command("scancel", "42", env=env).returncode == -signal.SIGPIPE
    assert (tmp_path / "scancel.calls").read_text().count("call") == 1


@pytest.fixture(scope="session")
def slurm_env():
    """A throw-away virtual cluster for this session (installs slurm-wlm, munge, MariaDB, sshfs, openssh-server
    when missing). Slurm's commands reach it through the wrappers in its bin/, which run them on its login node;
    its namespaces and addresses are its own (prefix plvct, SUBNET), apart from any other cluster's."""
    env = dict(os.environ, PIPELINERL_SLURM_STATE=CLUSTER_STATE, PIPELINERL_VCLUSTER_PREFIX="plvct",
               PIPELINERL_VCLUSTER_SUBNET=SUBNET)
    stop = [str(REPO / "tests/slurm/stop_cluster.sh")]
    subprocess.run(stop, env=env, check=True, timeout=300)  # what an interrupted session may have left
    started = time.monotonic()
    out = subprocess.run([str(REPO / "tests/slurm/start_cluster.sh")], check=False, env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    print(f"slurm cluster up in {time.monotonic() - started:.0f} s")
    bin_dir = str(Path(sys.executable).parent)  # the job's `python3` and torchrun: this environment's
    try:
        yield dict(env, SLURM_CONF=f"{CLUSTER_STATE}/slurm.conf", HF_HUB_OFFLINE="1",
                   PATH=f"{CLUSTER_STATE}/bin:{bin_dir}:{env['PATH']}", PIPELINERL_PYTHON=sys.executable)
    finally:
        subprocess.run(stop, env=env, check=True, timeout=300)


def _shared_dir(tmp_path: Path) -> Path:
    """A folder of this test on the cluster's network filesystem (run directories go there)."""
    path = SHARED / tmp_path.name
    path.mkdir(parents=True, exist_ok=True)
    return path


def _on_login(env: dict, code: str) -> str:
    """Python `code` run on the cluster's login node (its mounts: files as the network filesystem shows them)."""
    out = subprocess.run([f"{CLUSTER_STATE}/bin/on-login", sys.executable, "-c", code], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _slurm(env: dict, *argv: str) -> str:
    """A Slurm command's output (launch.slurm's runner: a query that did not reach the controller is asked
    again); a failure names the command and its error."""
    out = slurm.slurm_command(*argv, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


@pytest.fixture
def submitted(slurm_env):
    """The ids of the jobs a test submits (_sbatch appends); the ones still queued at its end are cancelled
    and awaited, so a failed test leaves neither a job nor its load to the next one."""
    jobs: list[str] = []
    yield jobs
    for job in jobs:
        if not _job_finished(slurm_env, job):
            slurm.slurm_command("scancel", job, env=slurm_env)
            _wait_until(f"the end of cancelled job {job}", lambda j=job: _job_finished(slurm_env, j), timeout_s=300)


def _sbatch(env: dict, jobs: list[str], tmp_path: Path, script: str, overrides: list[str],
            config: str | None = None) -> str:
    """Submit slurm/<script> from the repository root (as users do), optionally with another config file
    (PIPELINERL_CONFIG); returns the job id, also appended to `jobs` (the `submitted` fixture)."""
    env = env if config is None else dict(env, PIPELINERL_CONFIG=config)
    out = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/slurm-%j.out", f"slurm/{script}",
                          *overrides], env=env, cwd=REPO, capture_output=True, text=True, check=True, timeout=60)
    jobs.append(out.stdout.strip())
    return jobs[-1]


def _wait_until(what: str, ready, timeout_s: float, poll_s: float = 1.0, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
            raise TimeoutError(f"{what} not seen after {timeout_s:.0f} s\n{tail}")
        time.sleep(poll_s)


def _job_finished(env: dict, job_id: str) -> bool:
    return not _slurm(env, "squeue", "-h", "-j", job_id, "-o", "%i").strip()


def _sacct(env: dict, job_id: str, components: int = 2) -> list[dict]:
    """Accounting rows of a job (every restart: -D), once slurmdbd has the finished components."""
    fields = ["JobID", "JobName", "NodeList", "State"]

    seen: list[dict] = []

    def completed() -> bool:
        out = _slurm(env, "sacct", "-D", "-n", "-P", "-j", job_id, "-o", ",".join(fields))
        seen[:] = [dict(zip(fields, line.split("|"))) for line in out.splitlines()]
        return sum(r["State"] == "COMPLETED" and "." not in r["JobID"] for r in seen) >= components

    # slurmctld sends the records to slurmdbd from a queue: seconds when quiet, a bound for a loaded machine.
    try:
        _wait_until(f"{components} completed components of job {job_id} in sacct", completed, timeout_s=300)
    except TimeoutError as err:
        raise TimeoutError(f"{err}; its records: {seen}") from None
    return seen


def _meta(run_dir: Path) -> dict:
    latest = max((run_dir / "checkpoints").glob("step_*[0-9]"))
    return json.loads((latest / "meta.json").read_text())


def _consumed_samples(run_dir: Path, samples: int) -> list[dict]:
    """The first `samples` samples of the stream in reading order: what the trainer consumed."""
    reader = StreamReader(run_dir, "rollouts", StreamsConfig())
    rows: list[dict] = []
    while len(rows) < samples:
        for group in reader.read_groups(max_groups=64, timeout_s=5.0):
            rows.extend(group.to_pylist())
    assert len(rows) == samples, "the trainer consumes whole groups only"
    return rows


# The flagship shape (run_7b.sh's het job) with the tiny model: slurm/run_tiny_flagship.sh, 2 servers on the
# inference node, one CPU trainer rank on each of 2 training nodes, the actor on the first.
RANKS, SERVERS = 2, 2
JOB_TIMEOUT_S = 900  # a bound, not an estimate: on a loaded 2-core machine the two servers alone took 3-4 min
SERVER_START = "vLLM server version"  # the first line every server start writes to its (appended) log
UPDATED = '"POST /request_weight_update HTTP/1.1" 200'  # uvicorn's access line of an acknowledged update


def _trained_exactly_once(run_dir: Path, max_steps: int) -> dict[int, dict]:
    """Every rank's per-token zarr arrays together hold step k's samples of the stream (samples k*S ..
    (k+1)*S - 1 in reading order), for every step, once: the same multiset of behaviour log-probs (a lost,
    repeated, foreign or misplaced sample changes it). Returns each rank's arrays."""
    rows = _consumed_samples(run_dir, max_steps * SAMPLES_PER_STEP)
    assert len({r["sample_id"] for r in rows}) == len(rows)
    stats = {rank: read_token_stats(run_dir, f"rank{rank}") for rank in range(RANKS)}
    for step in range(max_steps):
        stream = [np.asarray(r["behaviour_logprobs"], dtype=np.float32)
                  for r in rows[step * SAMPLES_PER_STEP:(step + 1) * SAMPLES_PER_STEP]]
        trained = [s["behaviour_logprobs"][s["step"] == step] for s in stats.values()]
        assert all(len(t) for t in trained), f"step {step}: a rank trained nothing"
        np.testing.assert_array_equal(np.sort(np.concatenate(trained)), np.sort(np.concatenate(stream)),
                                      err_msg=f"step {step}")
    return stats


def _updates_per_server_start(run_dir: Path, node: str) -> dict[str, list[int]]:
    """server -> acknowledged weight updates of each of its starts, in order (server logs are appended)."""
    counts = {}
    for i in range(SERVERS):
        starts = (run_dir / "logs" / f"{node}_server{i}.log").read_text().split(SERVER_START)[1:]
        counts[f"server{i}"] = [part.count(UPDATED) for part in starts]
    return counts


def _assert_ends_with_summary(batch_log: Path, steps: int, run_dir: Path) -> None:
    """The batch log's last line is the run's summary: steps trained and the last checkpoint."""
    last = batch_log.read_text().strip().splitlines()[-1]
    assert last.startswith(f"summary: {steps} step(s) trained on {steps * SAMPLES_PER_STEP} samples; last "
                           f"checkpoint {run_dir}/checkpoints/step_{steps:08d}"), last


def _straddling(run_dir: Path, max_steps: int) -> int:
    """Consumed completions generated by two or more policy versions (in-flight updates)."""
    return sum(len(set(r["versions"])) > 1 for r in _consumed_samples(run_dir, max_steps * SAMPLES_PER_STEP))


def _actor_pid(run_dir: Path) -> int:
    """The actor's own process (not srun's, not its grading workers): on the one-host cluster it is ours to see."""
    want = ["-m", "pipelinerl.cli", "actor", str(run_dir / "config.yaml")]
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().decode().split("\0")[:-1]
        except (OSError, ValueError):
            continue
        if entry.name.isdigit() and argv[1:] == want:
            return int(entry.name)
    raise AssertionError(f"no actor process of {run_dir}")


def _stopped(pid: int) -> bool:
    return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def _samples_in_stream(run_dir: Path) -> int:
    """Every sample the rollout stream holds now (the actor stopped: nothing more comes)."""
    reader, samples = StreamReader(run_dir, "rollouts", StreamsConfig()), 0
    while True:
        try:
            samples += sum(group.num_rows for group in reader.read_groups(max_groups=64, timeout_s=2.0))
        except StreamTimeout:
            return samples


def _address(node: str) -> str:
    """The bridge address of virtual node vnI (its NodeAddr in Slurm)."""
    return f"{SUBNET}.{10 + int(node.removeprefix('vn'))}"


def _scalar_tags(env: dict, folder: Path) -> list[str]:
    """The scalar tags of a TensorBoard folder, read by TensorBoard's reader on the login node."""
    code = ("from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n"
            f"acc = EventAccumulator({str(folder)!r}, size_guidance={{'scalars': 0}})\n"
            "acc.Reload()\nprint('\\n'.join(acc.Tags()['scalars']))")
    return _on_login(env, code).split()


def _servers_step(env: dict, job: str) -> tuple[str, str]:
    """(step id, node) of the servers step of het component 0 (its only step besides the batch step)."""
    rows = [line.split() for line in _slurm(env, "squeue", "-h", "-s", "-j", job, "-o", "%i %N").splitlines()]
    steps = [row for row in rows if not row[0].endswith(".batch")]
    assert len(steps) == 1, rows
    return steps[0][0], steps[0][1]


def _kill_servers_step_at_a_checkpoint(env: dict, job: str, run_dir: Path,
                                      slurm_log: Path) -> tuple[str, int, int, int]:
    """SIGKILL the inference node's servers step at a moment that makes the restarted servers serve a
    checkpoint of at least the dead servers' version (a request retried on them then keeps the lag bound),
    and exactly the trainer's last one: the actor is stopped (SIGSTOP) first, so the trainer takes the steps
    the stream holds (N // S), broadcasts and checkpoints the last (checkpoints.every_steps=1), then waits for
    data. Once that checkpoint is complete: kill, wait until the launcher has run the step again (its command
    computed from that checkpoint) and every restarted server announced itself. Returns (the node, the
    checkpoint step, the trainer's last logged step once the actor had stopped, the actor's pid) with the actor
    still stopped: the trainer's next step then has every restarted server in its weight-update group."""
    actor = _actor_pid(run_dir)
    os.kill(actor, signal.SIGSTOP)
    try:
        _wait_until("the actor stopped", lambda: _stopped(actor), timeout_s=30, poll_s=0.1)
        trained = max(map(int, re.findall(r"step (\d+):", (run_dir / "logs" / "trainer_rank0.log").read_text())))
        steps = _samples_in_stream(run_dir) // SAMPLES_PER_STEP
        _wait_until(f"checkpoint {steps}", lambda: (latest_checkpoint(run_dir / "checkpoints") or Path()).name
                    == f"step_{steps:08d}", timeout_s=300, log=slurm_log)
        step, node = _servers_step(env, job)
        _slurm(env, "scancel", "--signal=KILL", step)
        restarted = re.compile(rf"role `servers@{node}` exited with code -?\d+; restarting it \(restart 1;.*"
                               rf"started servers@{node} \(pid", re.DOTALL)
        _wait_until(f"the restart of servers@{node}", lambda: restarted.search(slurm_log.read_text()),
                    timeout_s=120, log=slurm_log)
        # The launcher removed the dead servers' discovery files before it ran the step again: these are new.
        _wait_until("the restarted servers' announcements", lambda: len(list_servers(run_dir)) == SERVERS,
                    timeout_s=JOB_TIMEOUT_S, log=slurm_log)
        # ... each under the address Slurm has for the node (the node calls itself vnI.vcluster.test).
        assert {urlparse(url).hostname for url in list_servers(run_dir)} == {_address(node)}, list_servers(run_dir)
    except BaseException:
        os.kill(actor, signal.SIGCONT)
        raise
    return node, steps, trained, actor


@pytest.mark.slow
@pytest.mark.timeout(3 * JOB_TIMEOUT_S + 300)  # two starts of the job, one restart of its servers; ~8 min quiet
def test_flagship_shape_requeued_mid_run_trains_every_sample_once(slurm_env, submitted, tiny_model_dir, tmp_path):
    """Pipeline mode, max_lag 2. After step 2 the inference node's servers step is killed (scancel
    --signal=KILL): the launcher runs it again from the latest checkpoint and the servers take updates
    again. Then USR1 (Slurm's warning before the time limit): the job checkpoints, requeues itself and
    resumes. The two ranks together train the stream's samples once."""
    run_dir, max_steps, max_lag = _shared_dir(tmp_path) / "run", 16, 2
    overrides = _tiny_overrides(run_dir, tiny_model_dir, max_steps=max_steps, port=18430) + [
        f"actor.max_lag={max_lag}", "checkpoints.every_steps=1", "trainer.wait_log_s=5"]
    started = time.monotonic()
    job = _sbatch(slurm_env, submitted, tmp_path, "run_tiny_flagship.sh", overrides)
    trainer_log, slurm_log = run_dir / "logs" / "trainer_rank0.log", tmp_path / f"slurm-{job}.out"

    def trained_2_steps() -> bool:
        if trainer_log.is_file() and "step 2:" in trainer_log.read_text():
            return True
        assert not _job_finished(slurm_env, job), f"job {job} ended before step 2:\n{slurm_log.read_text()[-3000:]}"
        return False

    _wait_until("trainer step 2", trained_2_steps, timeout_s=JOB_TIMEOUT_S, poll_s=0.3, log=slurm_log)
    node, killed_at, trained, actor = _kill_servers_step_at_a_checkpoint(slurm_env, job, run_dir, slurm_log)
    # What the stream held when the actor stopped: no server then served a version past the trainer's next
    # (published, perhaps not yet logged), and the actor starts no sample more than max_lag steps ahead of it.
    assert 2 <= trained <= killed_at <= trained + 1 + max_lag + 1, (trained, killed_at)

    def stepped(step: int):
        def done() -> bool:
            assert not _job_finished(slurm_env, job), f"job {job} ended:\n{slurm_log.read_text()[-3000:]}"
            return f"step {step}:" in trainer_log.read_text()
        return done

    # The actor goes on. The trainer's next step re-forms the group with both restarted servers (announced)
    # and logs once they acknowledged its weights; then the actor stops again, so the trainer runs out of
    # data within max_lag + 1 more steps, before max_steps, and the requeue comes while it waits.
    try:
        os.kill(actor, signal.SIGCONT)
        _wait_until(f"trainer step {killed_at + 1}", stepped(killed_at + 1), timeout_s=JOB_TIMEOUT_S, log=slurm_log)
        os.kill(actor, signal.SIGSTOP)
        _wait_until("the actor stopped", lambda: _stopped(actor), timeout_s=30, poll_s=0.1)
        # Delivery runs beside the loop (weights/delivery.py): the restarted servers take that step's version
        # after the step is logged, within a round.
        _wait_until("the restarted servers' first update", lambda: all(
            len(c) == 2 and c[1] >= 1 for c in _updates_per_server_start(run_dir, node).values()),
            timeout_s=JOB_TIMEOUT_S, log=slurm_log)
        restarted_at = time.monotonic()
        # `pipelinerl status` on the login node, through the network filesystem, while the actor is stopped: the
        # trainer's wait for data past trainer.wait_log_s, the restarted servers step, its servers at a version.
        status = {}

        def stalled_and_shown() -> bool:
            status.update(json.loads(_on_login(slurm_env, "from pipelinerl.cli import main\n"
                                                           f"main(['status', {str(run_dir)!r}, '--json'])")))
            servers = [r for n, r in status["roles"].items() if n.startswith(f"{node}:server")]
            return (any(w["role"] == "trainer" for w in status["long_waits"]) and len(servers) == SERVERS
                    and all(r.get("server", {}).get("version", 0) >= 1 for r in servers))

        _wait_until("the trainer's wait and the servers' versions in `pipelinerl status`", stalled_and_shown,
                    timeout_s=300, poll_s=1.0, log=slurm_log)
        assert status["roles"][f"servers@{node}"]["restarts"] == 1, status["roles"]
        assert {"trainer", "actor0"} <= set(status["statuses"]) and status["statuses"]["trainer"]["step"] > 2
        # What Slurm sends signal_seconds before the time limit: USR1 to the batch shell only.
        _slurm(slurm_env, "scancel", "--batch", "--signal=USR1", job)
        signalled = time.monotonic()
        _wait_until("the trainer's checkpoint for the requeue",
                    lambda: "checkpointed at step" in trainer_log.read_text(), timeout_s=JOB_TIMEOUT_S, log=slurm_log)
    finally:
        os.kill(actor, signal.SIGCONT)  # it stops with the other roles
    _wait_until(f"the end of requeued job {job}", lambda: _job_finished(slurm_env, job), timeout_s=JOB_TIMEOUT_S,
                log=slurm_log)
    print(f"flagship pipeline + servers step killed + requeue: {time.monotonic() - started:.0f} s from sbatch to "
          f"the end ({restarted_at - started:.0f} s to the restarted servers' updates, "
          f"{time.monotonic() - signalled:.0f} s after the signal)")
    rows = _sacct(slurm_env, job)
    for component in (0, 1):
        assert [r["State"] for r in rows if r["JobID"] == f"{job}+{component}"] == ["REQUEUED", "COMPLETED"], rows
    text = trainer_log.read_text()
    stopped = int(re.search(r"stop signal 10: checkpointed at step (\d+)", text).group(1))
    assert killed_at < stopped < max_steps and f"resumed from {run_dir}/checkpoints/step_{stopped:08d}" in text
    meta = _meta(run_dir)
    assert meta["step"] == max_steps and meta["samples_seen"] == max_steps * SAMPLES_PER_STEP
    rank1 = (run_dir / "logs" / "trainer_rank1.log").read_text()  # each rank its own log
    assert f"train[rank 1] pipelinerl.trainer: stop signal 10: checkpointed at step {stopped}" in rank1
    assert "train[rank 1]" not in text
    _assert_ends_with_summary(slurm_log, max_steps, run_dir)
    stats = _trained_exactly_once(run_dir, max_steps)
    lag_max = {rank: int(s["lag"].max()) for rank, s in stats.items()}
    assert all(int(s["lag"].min()) >= 0 for s in stats.values()) and max(lag_max.values()) <= max_lag, lag_max
    # Each start took updates (delivery sends the newest version: one published while another is on its way
    # replaces it, so a start may skip versions): its first some of 1..killed_at; restarted at killed_at, some
    # of killed_at+1..stopped; after the requeue (started at `stopped`, the trainer's version: nothing to
    # catch up) some of stopped+1..max_steps, the last being max_steps.
    assert next(r["NodeList"] for r in rows if r["JobID"] == f"{job}+0") == node
    updates = _updates_per_server_start(run_dir, node)
    for counts in updates.values():
        assert len(counts) == 3 and 1 <= counts[0] <= killed_at and 1 <= counts[2] <= max_steps - stopped, updates
        assert 1 <= counts[1] <= stopped - killed_at, updates
    for i in range(SERVERS):
        served = re.findall(r"serving version (\d+)", (run_dir / "logs" / f"{node}_server{i}.log").read_text())
        assert int(served[-1]) == max_steps, served
    # The agent's three starts: the base model; the checkpoint at the kill, pinned (the trainer was running);
    # the checkpoint of the requeue.
    starts = (run_dir / "logs" / f"servers@{node}.log").read_text().split(f"pipelinerl slurm servers on {node}: ")[1:]
    assert [re.search(r"the policy from (\S+) at version (\d+)", start).groups() for start in starts] == [
        (str(tiny_model_dir), "0"), (f"{run_dir}/serving/servers@{node}", str(killed_at)),
        (f"{run_dir}/checkpoints/step_{stopped:08d}/hf", str(stopped))]
    # Hosts of their own: the servers' node is not a training node; each trainer rank's gloo crossed the bridge
    # on the node's cluster interface (not the loopback its hostname resolves to); the launcher recorded the
    # servers step's downtime (it saw the restarted servers' discovery files under the names it expected), and
    # the login node reads it, and the trainer's scalars, through the network filesystem.
    servers_nodes = [r["NodeList"] for r in rows if r["JobID"] == f"{job}+0"]
    training_nodes = [r["NodeList"] for r in rows if r["JobID"] == f"{job}+1"]
    for servers_node, nodelist in zip(servers_nodes, training_nodes, strict=True):  # each start of the job
        training = _slurm(slurm_env, "scontrol", "show", "hostnames", nodelist).split()
        assert len(training) == RANKS and servers_node not in training, (servers_node, training)
    for rank in range(RANKS):
        log = (run_dir / "logs" / f"trainer_rank{rank}.log").read_text()
        chosen = re.findall(r"gloo and NCCL sockets on interface (\S+) \((\S+): the route to", log)
        assert len(chosen) == 2 and all(i == "cl0" and a.startswith(f"{SUBNET}.") for i, a in chosen), chosen
    assert {f"launch/restarts/servers@{node}", f"launch/downtime_s/servers@{node}"} <= set(
        _scalar_tags(slurm_env, run_dir / "tb" / "launch"))
    assert "grpo_loss" in _scalar_tags(slurm_env, run_dir / "tb" / "trainer")
    print(f"servers step killed at checkpoint {killed_at}; stopped at step {stopped}; lag max per rank {lag_max}; "
          f"updates per server start {updates}; {_straddling(run_dir, max_steps)} completions straddled an update")


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 300)
def test_flagship_shape_in_conventional_mode(slurm_env, submitted, tiny_model_dir, tmp_path):
    """configs/tiny_cpu_conventional.yaml (G = 4 steps per generated batch, one sync per batch) on the same
    shape, trained by the FSDP2 backend (its ranks on two nodes; the other flagship runs train on DeepSpeed):
    each component on its own nodes, every sample trained once, lag <= G - 1 on every rank."""
    run_dir, max_steps, G = _shared_dir(tmp_path) / "run", 8, 4
    overrides = _tiny_overrides(run_dir, tiny_model_dir, max_steps=max_steps, port=18440) + [
        f"conventional.steps_per_batch={G}", f"actor.max_groups_in_flight={G * SAMPLES_PER_STEP // 8}",
        "trainer.backend=fsdp2"]
    started = time.monotonic()
    job = _sbatch(slurm_env, submitted, tmp_path, "run_tiny_flagship.sh", overrides,
                  config="configs/tiny_cpu_conventional.yaml")
    _wait_until(f"the end of job {job}", lambda: _job_finished(slurm_env, job), timeout_s=JOB_TIMEOUT_S,
                log=tmp_path / f"slurm-{job}.out")
    print(f"flagship conventional: {time.monotonic() - started:.0f} s from sbatch to its end")
    rows = _sacct(slurm_env, job)
    components = {r["JobID"]: r for r in rows if "." not in r["JobID"]}
    assert {c["State"] for c in components.values()} == {"COMPLETED"}, rows
    inference_node, training_nodes = components[f"{job}+0"]["NodeList"], components[f"{job}+1"]["NodeList"]
    assert len(_slurm(slurm_env, "scontrol", "show", "hostnames", training_nodes).split()) == RANKS
    assert inference_node not in training_nodes
    # srun steps ran inside each component: the servers in 0, the trainer and the actor in 1.
    steps = [r for r in rows if "." in r["JobID"] and not r["JobID"].endswith(".batch")]
    assert sum(r["JobID"].startswith(f"{job}+0.") for r in steps) == 1, rows
    assert sum(r["JobID"].startswith(f"{job}+1.") for r in steps) == 2, rows
    meta = _meta(run_dir)
    assert meta["step"] == max_steps and meta["samples_seen"] == max_steps * SAMPLES_PER_STEP
    assert meta["backend"] == "fsdp2", meta
    _assert_ends_with_summary(tmp_path / f"slurm-{job}.out", max_steps, run_dir)
    stats = _trained_exactly_once(run_dir, max_steps)
    lag_max = {rank: int(s["lag"].max()) for rank, s in stats.items()}
    assert max(lag_max.values()) <= G - 1 and all(int(s["lag"].min()) >= 0 for s in stats.values()), lag_max
    updates = _updates_per_server_start(run_dir, inference_node)  # one sync per batch: versions 4 and 8
    assert updates == {f"server{i}": [max_steps // G] for i in range(SERVERS)}, updates
    acc = EventAccumulator(str(run_dir / "tb" / "trainer"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("grpo_loss")][-1] == max_steps
    print(f"lag max per rank {lag_max}; updates per server {updates}")


@pytest.mark.slow
def test_submitit_sweep_of_two_points_prints_its_table(slurm_env, tiny_model_dir, tmp_path):
    shared = _shared_dir(tmp_path)
    overrides = _tiny_overrides(shared / "sweep", tiny_model_dir, max_steps=3, port=18460)
    out = subprocess.run([sys.executable, "tools/sweep.py", "configs/tiny_cpu.yaml", "--grid", "trainer.lr=1e-4,2e-4",
                          "--folder", str(shared / "submitit"), "--timeout-s", "540", *overrides],
                         check=False, env=slurm_env, cwd=REPO, capture_output=True, text=True, timeout=660)
    assert out.returncode == 0, out.stdout + out.stderr[-5000:]
    table = out.stdout.splitlines()[-3:]
    assert table[0].split()[:6] == ["point", "job", "state", "steps", "samples_seen", "reward_mean"]
    for line, lr in zip(table[1:], ("1e-4", "2e-4")):
        fields = line.split()
        assert fields[0] == f"trainer.lr={lr}" and fields[2:5] == ["COMPLETED", "3", str(3 * SAMPLES_PER_STEP)], line
        assert (shared / "sweep" / f"trainer.lr={lr}" / "checkpoints" / "step_00000003").is_dir()


@pytest.mark.slow
def test_staleness_study_runs_its_grid_as_a_job_array_reports_it_and_resumes(slurm_env, tiny_model_dir, tmp_path):
    """tools/study_staleness.py's plumbing (not its science): 2 objectives x 2 staleness levels at 2 steps each as
    one submitit job array, the report built from the run directories, and a second invocation that finds every
    point finished and runs nothing."""
    shared = _shared_dir(tmp_path)
    out_dir = shared / "study"
    overrides = _tiny_overrides(out_dir, tiny_model_dir, max_steps=2, port=18470) + [
        "actor.eval_every_steps=2", "actor.eval_samples=16"]
    argv = [sys.executable, "tools/study_staleness.py", "configs/tiny_cpu.yaml", "--objectives", "grpo,rloo",
            "--staleness", "1,2", "--seeds", "0", "--executor", "slurm", "--out", str(out_dir), "--timeout-s", "720",
            *overrides]
    out = subprocess.run(argv, check=False, env=slurm_env, cwd=REPO, capture_output=True, text=True, timeout=840)
    assert out.returncode == 0, out.stdout + out.stderr[-5000:]
    assert "4 point(s), 4 pending" in out.stdout and "submitted job array" in out.stdout
    report = (out_dir / "report.md").read_text()
    rows = [line.split("|")[1:-1] for line in report.splitlines() if line.startswith("| grpo") or
            line.startswith("| rloo")]
    assert [(r[0].strip(), r[1].strip(), r[2].strip()) for r in rows] == [
        (o, f"conventional.steps_per_batch={n}", "1") for o in ("grpo", "rloo") for n in (1, 2)]
    for row, n in zip(rows, (1, 2, 1, 2)):
        lag_p95, gold = row[4].strip(), row[5].strip()
        assert lag_p95 == str(n - 1), row  # a batch of N steps trains its last step's samples N - 1 versions late
        assert gold != "-" and 0 <= float(gold) <= 1, row  # evaluated at version 2 by the task's check
    for image in ("frontier.png", "gold_vs_lag.png"):
        assert (out_dir / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = subprocess.run(argv, check=False, env=slurm_env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "4 point(s), 0 pending" in again.stdout, again.stdout + again.stderr[-3000:]
    assert "submitted" not in again.stdout
