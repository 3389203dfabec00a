"""Slurm launch: the sbatch scripts' rendered srun lines and headers (fast), then real jobs on a
throw-away Slurm cluster on this machine (tests/slurm/start_cluster.sh, slow): the tiny pipeline as a
heterogeneous job, a requeue mid-run that must neither lose nor repeat a sample, and a submitit sweep.

The cluster runs as root with state under /tmp; its daemons are stopped when the session ends.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipelinerl.config import StreamsConfig, load_config
from pipelinerl.launch.slurm import _node_gpus, check_config
from pipelinerl.metrics import read_token_stats
from pipelinerl.streams import StreamReader

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = {"run_7b.sh": "configs/qwen7b_orz.yaml", "run_32b.sh": "configs/qwen32b_orz.yaml",
           "run_tiny.sh": "configs/tiny_cpu.yaml"}
CLUSTER_STATE = "/tmp/pipelinerl-slurm-tests"
SAMPLES_PER_STEP = 32


def _tiny_overrides(run_dir: Path, model_dir: Path, max_steps: int, port: int = 18400) -> list[str]:
    """A shortened tiny run on ports of this test module's range (18400-18499)."""
    return [f"run_dir={run_dir}", f"model.path={model_dir}", "model.build_tiny_if_missing=false",
            f"trainer.max_steps={max_steps}", f"trainer.samples_per_step={SAMPLES_PER_STEP}",
            "actor.sampling.max_new_tokens=8", "actor.eval_every_steps=0", "actor.max_groups_in_flight=8",
            "inference.max_model_len=64", "streams.segment_max_seconds=0.5", "checkpoints.every_steps=null",
            f"inference.base_port={port}", f"trainer.broadcast_port={port + 40}", f"launch.slurm.master_port={port + 60}"]


# -- rendered commands and script headers (no cluster) -----------------------------------------------------

def _dry_run(script: str) -> dict[str, list[str]]:
    """role -> the srun argv `bash slurm/<script> --dry-run` prints for it."""
    out = subprocess.run(["bash", f"slurm/{script}", "--dry-run"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PIPELINERL_PYTHON=sys.executable), check=True).stdout
    roles, lines = {}, out.splitlines()
    for header, command in zip(lines, lines[1:]):
        if found := re.match(r"# (\w+) \(log ", header):
            argv = shlex.split(command)
            roles[found.group(1)] = argv[argv.index("srun"):]
    assert set(roles) == {"servers", "trainer", "actor"}, out
    return roles


def _torchrun_args(trainer: list[str]) -> str:
    assert trainer[-3:-1] == ["bash", "-c"]
    return trainer[-1]


def test_7b_script_renders_one_inference_and_one_training_node():
    roles = _dry_run("run_7b.sh")
    assert roles["servers"][:6] == ["srun", "--het-group=0", "--nodes=1", "--nodelist=inference0",
                                    "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert "--gpus-per-node=8" in roles["servers"]
    assert roles["servers"][-7:] == ["slurm", "servers", "runs/qwen7b_orz/config.yaml", "--model",
                                     "/models/Qwen2.5-7B", "--version", "0"]
    trainer = roles["trainer"]
    assert trainer[1:4] == ["--het-group=1", "--nodes=1", "--nodelist=training0"] and "--gpus-per-node=8" in trainer
    torchrun = _torchrun_args(trainer)
    for arg in ("--nnodes=1", "--nproc-per-node=8", "--master-addr=training0", '--node-rank="$SLURM_NODEID"',
                "-m pipelinerl.cli train runs/qwen7b_orz/config.yaml"):
        assert arg in torchrun
    actor = roles["actor"]
    assert actor[1:4] == ["--het-group=1", "--nodes=1", "--nodelist=training0"] and "--overlap" in actor
    assert not any(a.startswith("--gpus") for a in actor)


def test_32b_script_renders_two_inference_and_two_training_nodes():
    roles = _dry_run("run_32b.sh")
    assert roles["servers"][1:4] == ["--het-group=0", "--nodes=2", "--nodelist=inference0,inference1"]
    assert roles["trainer"][1:4] == ["--het-group=1", "--nodes=2", "--nodelist=training0,training1"]
    torchrun = _torchrun_args(roles["trainer"])
    assert "--nnodes=2" in torchrun and "--nproc-per-node=8" in torchrun and "--master-addr=training0" in torchrun
    assert roles["actor"][1:4] == ["--het-group=1", "--nodes=1", "--nodelist=training0"]
    # Each inference node splits its 8 GPUs into two tensor-parallel groups of 4, one server each.
    cfg = load_config(REPO / "configs/qwen32b_orz.yaml")
    os.environ["CUDA_VISIBLE_DEVICES"] = "0,1,2,3,4,5,6,7"
    try:
        assert _node_gpus(cfg) == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    finally:
        del os.environ["CUDA_VISIBLE_DEVICES"]


def _sbatch_components(script: str) -> tuple[dict[str, str], list[dict[str, str]]]:
    """(job-wide #SBATCH options, per-component options) of a het-job script."""
    job, components = {}, [{}]
    for line in (REPO / "slurm" / script).read_text().splitlines():
        if not line.startswith("#SBATCH"):
            continue
        if line.split()[1] == "hetjob":
            components.append({})
            continue
        for opt in line.split()[1:]:
            key, _, value = opt.lstrip("-").partition("=")
            target = components[-1] if key in ("nodes", "ntasks-per-node", "gpus-per-node", "exclusive", "mem") else job
            target[key] = value
    return job, components


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_sbatch_lines_match_the_script_config(script):
    cfg = load_config(REPO / SCRIPTS[script])
    check_config(cfg)
    s = cfg.launch.slurm
    job, (inference, training) = _sbatch_components(script)
    assert job["signal"] == f"B:USR1@{s.signal_seconds}" and "requeue" in job and job["time"] == s.time
    assert int(inference["nodes"]) == s.inference_nodes and int(training["nodes"]) == s.training_nodes
    for component in (inference, training):
        assert component.get("gpus-per-node") == (None if s.gpus_per_node is None else str(s.gpus_per_node))


def _shellcheck() -> str:
    if shutil.which("shellcheck") is None:  # CI starts from a bare Debian: install it like the cluster packages
        subprocess.run(["apt-get", "update", "-qq"], check=True, timeout=300)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "shellcheck"], check=True,
                       timeout=600, env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    return "shellcheck"


def test_scripts_pass_bash_n_and_shellcheck():
    scripts = sorted(str(p.relative_to(REPO)) for p in [*(REPO / "slurm").glob("*.sh"),
                                                         *(REPO / "tests" / "slurm").glob("*.sh")])
    for script in scripts:
        subprocess.run(["bash", "-n", script], cwd=REPO, check=True, timeout=60)
    out = subprocess.run([_shellcheck(), "-x", *scripts], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout


def test_trainer_ranks_must_match_the_training_gpus():
    cfg = load_config(REPO / "configs/qwen7b_orz.yaml", ["trainer.num_gpus=16"])
    with pytest.raises(ValueError, match="trainer.num_gpus=16 .* gives 8 trainer ranks"):
        check_config(cfg)
