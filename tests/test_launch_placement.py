"""One machine split between the roles: GPU lists, the local launcher's placement and --dry-run output,
and `pipelinerl train --nproc`'s ranks (real processes: every stop signal reaches every rank)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelinerl.config import ConfigError, load_config
from pipelinerl.launch.local import _roles, placement
from pipelinerl.launch.placement import parse_gpu_ids, split_node
from pipelinerl.launch.ranks import run_ranks

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny_cpu.yaml"


def test_gpu_lists_parse_and_bad_ones_are_refused():
    assert parse_gpu_ids("0-3,6") == ["0", "1", "2", "3", "6"]
    assert parse_gpu_ids("5") == ["5"]
    for bad in ("a", "1-", "0,0", "-2"):
        with pytest.raises(ValueError):
            parse_gpu_ids(bad)
    with pytest.raises(ConfigError, match="launch.training_gpus"):
        load_config(TINY, ["launch.training_gpus=4-x"])


def test_one_node_split_defaults_to_halves_and_checks_fit_and_overlap():
    plan = split_node(8, None, None, num_servers=2, tensor_parallel_size=2, trainer_ranks=None)
    assert plan.server_gpus == [["0", "1"], ["2", "3"]] and plan.trainer_gpus == ["4", "5", "6", "7"]
    assert plan.trainer_ranks == 4
    plan = split_node(8, "0-5", "6,7", num_servers=6, tensor_parallel_size=1, trainer_ranks=None)
    assert plan.server_gpus == [[str(i)] for i in range(6)] and plan.trainer_gpus == ["6", "7"]
    assert split_node(0, None, None, 3, 1, trainer_ranks=3).trainer_ranks == 3  # CPU: gloo ranks
    errors = {("0-4", "4-7", 1, 1, None): "share GPU.s. 4", (None, None, 3, 2, None): "needs 6 GPUs",
              ("0-3", "4-7", 1, 1, 5): "5 trainer ranks need 5 GPUs", ("0-3", "4-9", 1, 1, None): "GPUs 0-7"}
    for (inference, training, servers, tp, ranks), message in errors.items():
        with pytest.raises(ValueError, match=message):
            split_node(8, inference, training, servers, tp, ranks)
    with pytest.raises(ValueError, match="no GPU"):
        split_node(0, "0", None, 1, 1, None)


def test_local_roles_get_disjoint_gpus_in_the_launchers_own_ids(tmp_path):
    cfg = load_config(TINY, [f"run_dir={tmp_path}", "inference.num_servers=3", "launch.inference_gpus=0-2",
                             "launch.training_gpus=3-4", "trainer.num_gpus=2"])
    visible = ["10", "11", "12", "13", "14"]  # a launcher started under CUDA_VISIBLE_DEVICES=10-14
    servers, trainer, actor = _roles(cfg, tmp_path / "config.yaml", placement(cfg, visible))
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in servers] == ["10", "11", "12"]
    argv = trainer.argv
    assert argv[argv.index("--nproc") + 1] == "2" and argv[argv.index("--gpus") + 1] == "13,14"
    assert "CUDA_VISIBLE_DEVICES" not in trainer.env and "CUDA_VISIBLE_DEVICES" not in actor.env
    cpu = load_config(TINY, [f"run_dir={tmp_path}", "trainer.num_gpus=3", "trainer.samples_per_step=48"])
    servers, trainer, _ = _roles(cpu, tmp_path / "config.yaml", placement(cpu, []))
    assert "CUDA_VISIBLE_DEVICES" not in servers[0].env and "--gpus" not in trainer.argv
    assert trainer.argv[trainer.argv.index("--nproc") + 1] == "3"


def test_eval_servers_take_gpu_slots_and_their_own_cores_and_restart_from_the_latest_checkpoint(tmp_path):
    """inference.eval_servers: after the policy and frozen servers, each on the next server GPUs; on
    launch.eval_cpus (affinity and vLLM's OMP binding; outside the inference_cpus split, and allowed to share the
    trainer's cores); announced in RUN_DIR/eval_servers; restarted like a policy server, from the latest
    checkpoint pinned under local_eval<i>."""
    cfg = load_config(TINY, [f"run_dir={tmp_path}", "inference.num_servers=2", "inference.eval_servers=1",
                             "rl.kl_coef=0.1", "inference.base_port=18200"])
    servers, _, _ = _roles(cfg, tmp_path / "config.yaml", placement(cfg, [str(i) for i in range(8)]))
    assert [(r.name, r.env["CUDA_VISIBLE_DEVICES"]) for r in servers] == [
        ("server0", "0"), ("server1", "1"), ("reference0", "2"), ("eval0", "3")]  # the first half of the GPUs
    with pytest.raises(ConfigError, match="needs 4 GPUs; the servers have 3"):
        placement(cfg, [str(i) for i in range(6)])  # the eval server's slot is the fourth
    pinned = load_config(TINY, [f"run_dir={tmp_path}", "inference.num_servers=2", "inference.eval_servers=1",
                                "launch.inference_cpus=0-1", "launch.training_cpus=2", "launch.eval_cpus=2"])
    servers, trainer, _ = _roles(pinned, tmp_path / "config.yaml", placement(pinned, [], cores=[0, 1, 2]))
    assert [(r.name, r.cpus) for r in servers] == [("server0", [0]), ("server1", [1]), ("eval0", [2])]
    assert trainer.cpus == [2]  # shared with the eval server, which mostly waits
    cfg = load_config(TINY, [f"run_dir={tmp_path}", "inference.eval_servers=1", "launch.eval_cpus=1"])
    servers, _, _ = _roles(cfg, tmp_path / "config.yaml", placement(cfg, [], cores=[0, 1]))
    server, evaluator = servers
    assert server.cpus is None and server.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"  # the others float
    assert evaluator.cpus == [1] and evaluator.env == {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert evaluator.log_path == tmp_path / "logs" / "eval0.log"
    assert evaluator.discovery == tmp_path / "eval_servers" / f"127.0.0.1_{cfg.inference.base_port + 2}"
    checkpoint = tmp_path / "checkpoints" / "step_00000005"
    (checkpoint / "hf").mkdir(parents=True)
    (checkpoint / "hf" / "model.safetensors").write_text("weights of step 5")
    (checkpoint / "meta.json").write_text('{"step": 5, "version": 5}')
    argv = evaluator.restart_argv()
    changed = [(old, new) for old, new in zip(evaluator.argv, argv) if old != new]
    assert changed == [(cfg.model.path, str(tmp_path / "serving" / "local_eval0")), ("0", "5")]
    assert (tmp_path / "serving" / "local_eval0" / "model.safetensors").read_text() == "weights of step 5"
    assert "--eval" in argv and len(argv) == len(evaluator.argv)
    with pytest.raises(ConfigError, match="launch.eval_cpus = 5 names core.s. 5 that this launcher may not use"):
        placement(load_config(TINY, ["inference.eval_servers=1", "launch.eval_cpus=5"]), [], cores=[0, 1])
    with pytest.raises(ConfigError, match="launch.eval_cpus gives 1 core.s. .1.; it needs at least 2"):
        placement(load_config(TINY, ["inference.eval_servers=1", "launch.eval_cpus=1",
                                     "inference.tensor_parallel_size=2"]), [], cores=[0, 1])


def test_dry_run_prints_every_roles_gpus(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "run", "--dry-run", str(TINY), f"run_dir={tmp_path}",
                          "inference.num_servers=2", "inference.tensor_parallel_size=2"], capture_output=True,
                         text=True, timeout=120, check=True,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"))
    lines = out.stdout.splitlines()
    assert lines[:4] == ["# GPUs on this machine: 0,1,2,3,4,5,6,7", "# server0: GPUs 0,1", "# server1: GPUs 2,3",
                         "# trainer: 4 rank(s) on GPUs 4,5,6,7"]
    assert any("CUDA_VISIBLE_DEVICES=2,3 " in line and " serve " in line for line in lines)
    assert any(" train " in line and "--nproc 4" in line and "--gpus 4,5,6,7" in line for line in lines)
    assert not (tmp_path / "config.yaml").exists()  # started nothing, wrote nothing


def test_dry_run_shows_the_eval_servers_and_their_cores(tmp_path):
    from pipelinerl.launch.local import render

    cfg = load_config(TINY, [f"run_dir={tmp_path}", "inference.eval_servers=1", "launch.eval_cpus=1"])
    lines = render(cfg, tmp_path / "config.yaml", []).splitlines()
    assert lines[:4] == ["# GPUs on this machine: none (CPU)", "# server0: CPU", "# eval0: CPU",
                         "# eval servers: CPU cores 1 (shared)"]
    header = lines.index(f"# eval0 (log {tmp_path / 'logs' / 'eval0.log'})")
    assert "VLLM_CPU_OMP_THREADS_BIND=1 taskset -c 1 " in lines[header + 1] and " serve " in lines[header + 1]
    assert " --eval --model " in lines[header + 1]


RANK_SCRIPT = """
import os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
visible = os.environ.get('CUDA_VISIBLE_DEVICES', '')
ready = out / f"ready{os.environ['RANK']}"
ready.with_suffix(".tmp").write_text(os.environ['WORLD_SIZE'] + " " + visible)
ready.with_suffix(".tmp").rename(ready)  # whole once it exists: the test reads it as soon as it sees it
while not got:
    time.sleep(0.05)
(out / f"signalled{os.environ['RANK']}").touch()
sys.exit(int(os.environ['RANK']) if sys.argv[2] == 'fail' else 0)
"""


def _start_ranks(tmp_path: Path, mode: str) -> subprocess.Popen:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    argv = f"[sys.executable, {str(script)!r}, {str(tmp_path)!r}, {mode!r}]"
    code = (f"import sys; from pipelinerl.launch.ranks import run_ranks; "
            f"sys.exit(run_ranks({argv}, 3, 29999, ['5', '6', '7'], grace_s=5))")
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{r}").exists() for r in range(3)):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    return proc


def test_ranks_get_their_environment_and_every_stop_signal(tmp_path):
    proc = _start_ranks(tmp_path, "ok")
    assert {(tmp_path / f"ready{r}").read_text() for r in range(3)} == {"3 5,6,7"}
    proc.send_signal(signal.SIGUSR1)  # what Slurm / the local launcher send: one signal to the parent
    assert proc.wait(timeout=60) == 0
    assert all((tmp_path / f"signalled{r}").exists() for r in range(3))


def test_a_failed_rank_stops_the_others_and_its_code_is_the_exit_code(tmp_path):
    proc = _start_ranks(tmp_path, "fail")
    proc.send_signal(signal.SIGUSR1)  # rank 0 exits 0, ranks 1 and 2 fail with their rank number
    assert proc.wait(timeout=60) in (1, 2)


def test_more_ranks_than_gpus_is_refused():
    with pytest.raises(ValueError, match="3 trainer ranks need 3 GPUs"):
        run_ranks(["true"], 3, 29999, ["0", "1"])
