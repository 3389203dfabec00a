"""One home for every role's command line, ports and thread environment (launch/commands.py): the local
launcher and the Slurm node agent start the same `serve` for the same slot."""

import itertools
from pathlib import Path

from pipelinerl.config import load_config
from pipelinerl.launch.local import _roles, placement
from pipelinerl.launch.slurm import dry_run_allocation, plan_roles
from pipelinerl.launch.slurm_node import node_server_roles

REPO = Path(__file__).resolve().parent.parent


def test_local_and_slurm_servers_share_command_line_ports_and_threads(tmp_path):
    cfg = load_config(REPO / "configs/tiny_cpu.yaml", [f"run_dir={tmp_path}", "inference.num_servers=4",
                                                       "inference.base_port=18000", "launch.torch_threads=2",
                                                       "rl.kl_coef=0.1", "inference.reference_servers=1",
                                                       "reward.kind=model", "reward.model_path=rm", "reward.servers=2"])
    config = str(tmp_path / "config.yaml")
    local, trainer, actor = _roles(cfg, Path(config), placement(cfg, []))
    node = node_server_roles(cfg, config, cfg.model.path, 0, "n0", side=True)
    # Locally the reference and reward servers come after every policy slot; on Slurm they take the first slots.
    assert [r.name for r in local] == ["server0", "server1", "server2", "server3", "reference0", "reward0", "reward1"]
    assert [r.name for r in node] == ["reference0", "reward0", "reward1", "server3"]
    assert [r.name for r in node_server_roles(cfg, config, cfg.model.path, 0, "n1", side=False)] == [
        f"server{i}" for i in range(4)]
    by_name = {r.name: r for r in local}
    for role in node:
        assert role.argv == by_name[role.name].argv and role.env == by_name[role.name].env == {
            "OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # unpinned: the OS places threads
        assert role.discovery == by_name[role.name].discovery
    ports = [int(r.argv[r.argv.index("--port") + 1]) for r in local]
    # reference i: base_port + num_servers + i; reward i: after inference.reference_servers of them
    assert ports == [18000, 18001, 18002, 18003, 18004, 18005, 18006]
    assert [r.argv[r.argv.index("serve") + 2] for r in local[4:]] == ["--reference", "--reward", "--reward"]
    assert [Path(str(r.discovery)).parent.name for r in local] == ["servers"] * 4 + ["reference_servers"] + [
        "reward_servers"] * 2
    slurm_roles = plan_roles(cfg, dry_run_allocation(cfg), Path(config))
    for role in (trainer, actor, *slurm_roles.values()):
        assert role.env.get("OMP_NUM_THREADS") == "2", role.name


def test_eval_servers_come_after_every_other_kind_and_are_policy_servers_announced_apart(tmp_path):
    cfg = load_config(REPO / "configs/tiny_cpu.yaml", [f"run_dir={tmp_path}", "inference.num_servers=5",
                                                       "inference.base_port=18000", "rl.kl_coef=0.1",
                                                       "inference.reference_servers=1", "reward.kind=model",
                                                       "reward.model_path=rm", "reward.servers=2",
                                                       "inference.eval_servers=2"])
    config = str(tmp_path / "config.yaml")
    local, _, _ = _roles(cfg, Path(config), placement(cfg, []))
    assert [r.name for r in local] == [*(f"server{i}" for i in range(5)), "reference0", "reward0", "reward1",
                                       "eval0", "eval1"]
    ports = [int(r.argv[r.argv.index("--port") + 1]) for r in local]
    # eval i: base_port + num_servers + reference_servers + reward servers + i
    assert ports == list(range(18000, 18010))
    evals = local[-2:]
    assert [Path(str(r.discovery)).parent.name for r in evals] == ["eval_servers"] * 2
    # A policy server's command line (the same model, version and served name) with --eval, on its own port.
    assert local[0].argv[local[0].argv.index("serve"):] == [
        "serve", config, "--model", cfg.model.path, "--port", "18000", "--version", "0",
        f"inference.engine_args.served_model_name={cfg.model.path}"]
    assert evals[1].argv[evals[1].argv.index("serve"):] == [
        "serve", config, "--eval", "--model", cfg.model.path, "--port", "18009", "--version", "0",
        f"inference.engine_args.served_model_name={cfg.model.path}"]
    # On Slurm the side kinds take the first slots of the node that hosts them: reference, reward, then eval.
    node = node_server_roles(cfg, config, cfg.model.path, 0, "n0", side=True)
    assert [r.name for r in node] == ["reference0", "reward0", "reward1", "eval0", "eval1"]
    by_name = {r.name: r for r in local}
    assert all(r.argv == by_name[r.name].argv and r.discovery == by_name[r.name].discovery for r in node)


def test_server_ports_of_every_kind_are_distinct_and_within_the_checked_range(tmp_path):
    """Whichever kinds a run starts, its servers' ports never collide and stay below base_port + the count the
    root config checks against 65535 (reference servers count even when not started: their offset does)."""
    from pipelinerl.launch.commands import server_port, side_server_counts

    for kl, reward, evals in itertools.product((0.0, 0.1), ("verify", "model"), (0, 1, 3)):
        cfg = load_config(REPO / "configs/tiny_cpu.yaml", [
            f"run_dir={tmp_path}", "inference.num_servers=3", "inference.reference_servers=2", f"rl.kl_coef={kl}",
            f"reward.kind={reward}", "reward.model_path=rm", "reward.servers=2", f"inference.eval_servers={evals}"])
        inf = cfg.inference
        ports = [server_port(cfg, i) for i in range(inf.num_servers)]
        ports += [server_port(cfg, i, kind) for kind, n in side_server_counts(cfg).items() for i in range(n)]
        checked = inf.num_servers + inf.reference_servers + cfg.reward.servers_started + inf.eval_servers
        assert len(set(ports)) == len(ports) and max(ports) < inf.base_port + checked, (kl, reward, evals)
