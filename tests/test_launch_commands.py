"""One home for every role's command line, ports and thread environment (launch/commands.py): the local
launcher and the Slurm node agent start the same `serve` for the same slot."""

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
    node = node_server_roles(cfg, config, cfg.model.path, 0, "n0", frozen=True)
    # Locally the reference and reward servers come after every policy slot; on Slurm they take the first slots.
    assert [r.name for r in local] == ["server0", "server1", "server2", "server3", "reference0", "reward0", "reward1"]
    assert [r.name for r in node] == ["reference0", "reward0", "reward1", "server3"]
    assert [r.name for r in node_server_roles(cfg, config, cfg.model.path, 0, "n1", frozen=False)] == [
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
