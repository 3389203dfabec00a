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

    for kl, reward, evals, envs in itertools.product((0.0, 0.1), ("verify", "model"), (0, 1, 3), (0, 2)):
        if reward != "verify" and envs:  # refused: an OpenEnv environment's episodes are graded by it
            continue
        openenv = ["task.name=openenv", "task.openenv.serve=m:app", f"task.openenv.servers={envs}"] if envs else []
        cfg = load_config(REPO / "configs/tiny_cpu.yaml", [
            f"run_dir={tmp_path}", "inference.num_servers=3", "inference.reference_servers=2", f"rl.kl_coef={kl}",
            f"reward.kind={reward}", "reward.model_path=rm", "reward.servers=2", f"inference.eval_servers={evals}",
            *openenv])
        inf = cfg.inference
        ports = [server_port(cfg, i) for i in range(inf.num_servers)]
        ports += [server_port(cfg, i, kind) for kind, n in side_server_counts(cfg).items() for i in range(n)]
        ports += [server_port(cfg, i, "openenv") for i in range(cfg.task.openenv_servers_started)]
        checked = (inf.num_servers + inf.reference_servers + cfg.reward.servers_started + inf.eval_servers
                   + cfg.task.openenv_servers_started)
        assert len(set(ports)) == len(ports) and max(ports) < inf.base_port + checked, (kl, reward, evals, envs)


def test_openenv_servers_are_roles_of_both_launchers_and_the_dry_run_prints_them(tmp_path):
    """task.openenv.serve: `openenv-serve` roles after every vLLM server's port, announced in RUN_DIR/openenv_servers/,
    on this machine (`pipelinerl run`, its --dry-run) and on every Slurm server node (its agent's roles, and the
    files its servers step is up again with)."""
    from pipelinerl.launch.local import openenv_roles, render
    from pipelinerl.launch.slurm import node_discovery_files
    from pipelinerl.launch.slurm import render as slurm_render

    cfg = load_config(REPO / "configs/tiny_openenv.yaml", [f"run_dir={tmp_path}", "inference.num_servers=2",
                                                           "inference.base_port=18000", "task.openenv.servers=2"])
    config = str(tmp_path / "config.yaml")
    local = openenv_roles(cfg, Path(config))
    assert [r.name for r in local] == ["openenv0", "openenv1"]
    # after 2 policy slots and the reference servers' (counted even when not started)
    assert [r.argv[r.argv.index("openenv-serve"):] for r in local] == [
        ["openenv-serve", config, "--port", str(port)] for port in (18003, 18004)]
    assert [str(r.discovery) for r in local] == [f"{tmp_path}/openenv_servers/127.0.0.1_{p}" for p in (18003, 18004)]
    assert all(r.restart_argv is None and r.restartable for r in local)  # restarted with the same command
    dry = render(cfg, Path(config), [])
    for role in local:
        assert f"# {role.name} (log {role.log_path})" in dry and " ".join(role.argv) in dry
    assert not openenv_roles(load_config(REPO / "configs/tiny_openenv.yaml", [
        f"run_dir={tmp_path}", "task.openenv.serve=null", "task.openenv.path=null", "task.openenv.url=http://x:1"]),
        Path(config))
    for node in ("n0", "n1"):
        roles = node_server_roles(cfg, config, cfg.model.path, 0, node, side=node == "n0")
        assert [r.name for r in roles] == ["server0", "server1", "openenv0", "openenv1"]
        assert [(r.argv, r.discovery) for r in roles[2:]] == [(r.argv, r.discovery) for r in local]
    slurm_cfg = load_config(REPO / "configs/tiny_openenv.yaml", [f"run_dir={tmp_path}", "inference.num_servers=2",
                                                                 "inference.base_port=18000", "task.openenv.servers=2",
                                                                 "inference.host=0.0.0.0"])
    alloc = dry_run_allocation(slurm_cfg)
    files = node_discovery_files(slurm_cfg, alloc, "inference0").paths
    assert [f"{f.parent.name}/{f.name}" for f in files[2:]] == [
        f"openenv_servers/inference0_{p}" for p in (18003, 18004)]
    slurm_dry = slurm_render(slurm_cfg, alloc)
    assert all(f"openenv-serve {tmp_path}/config.yaml --port {p}" in slurm_dry for p in (18003, 18004))
