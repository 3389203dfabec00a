"""`pipelinerl slurm script`: every shipped slurm/run_*.sh is the rendering of its config (re-rendered
here and compared byte for byte), its #SBATCH lines agree with the config's launch.slurm, and the scripts
pass `bash -n` and shellcheck."""

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from pipelinerl.config import load_config
from pipelinerl.launch.script import render_script, sbatch_lines
from pipelinerl.launch.slurm import check_config
from pipelinerl.launch.slurm_cli import _parser, main
from pipelinerl.launch.slurm_node import node_placement

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p.name for p in (REPO / "slurm").glob("run_*.sh"))


def _render_command(script: str) -> list[str]:
    """The `pipelinerl slurm script ...` arguments a script's header names as its source."""
    found = re.search(r"^#   pipelinerl slurm script (.*) > (\S+)$", (REPO / "slurm" / script).read_text(), re.M)
    assert found, f"slurm/{script} does not name the command that rendered it"
    assert found.group(2) == f"slurm/{script}"
    return shlex.split(found.group(1))


def test_every_shipped_script_is_covered():
    assert SCRIPTS == ["run_30b_a3b.sh", "run_32b.sh", "run_7b.sh", "run_7b_one_node.sh", "run_8b_rlhf.sh",
                       "run_tiny.sh", "run_tiny_flagship.sh"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_shipped_script_equals_its_rendering(script, monkeypatch):
    monkeypatch.chdir(REPO)  # the command names the config relative to the repository root
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["script", *_render_command(script)])
    assert out.getvalue() == (REPO / "slurm" / script).read_text(), (
        f"slurm/{script} differs from its rendering: run the command in its header")
    assert os.access(REPO / "slurm" / script, os.X_OK)


def _script_config(script: str):
    """The config a script runs: its default config file with the script's own --shape overrides."""
    args = _parser().parse_args(["script", *_render_command(script)])
    return load_config(REPO / args.config, args.overrides)


def _sbatch_components(script: str) -> tuple[dict[str, str], list[dict[str, str]]]:
    """(job-wide #SBATCH options, per-component options) of a script (one component unless het)."""
    job, components = {}, [{}]
    for line in (REPO / "slurm" / script).read_text().splitlines():
        if not line.startswith("#SBATCH"):
            continue
        if line.split()[1] == "hetjob":
            components.append({})
            continue
        for opt in line.split()[1:]:
            key, _, value = opt.lstrip("-").partition("=")
            per_component = ("nodes", "ntasks-per-node", "gpus-per-node", "exclusive", "mem")
            target = components[-1] if key in per_component else job
            target[key] = value
    return job, components


@pytest.mark.parametrize("script", SCRIPTS)
def test_sbatch_lines_match_the_script_config(script):
    cfg = _script_config(script)
    check_config(cfg)
    s = cfg.launch.slurm
    job, components = _sbatch_components(script)
    assert job["signal"] == f"B:USR1@{s.signal_seconds}" and "requeue" in job and job["time"] == s.time
    if s.inference_nodes == 0:  # colocated: one homogeneous component of nodes that serve and train
        assert len(components) == 1
        (training,) = components
    else:
        inference, training = components
        assert int(inference["nodes"]) == s.inference_nodes and inference["ntasks-per-node"] == "1"  # servers agent
    assert int(training["nodes"]) == s.training_nodes
    for component in components:
        assert component.get("gpus-per-node") == (None if s.gpus_per_node is None else str(s.gpus_per_node))
    # One task per trainer rank (per GPU it trains on) on the training nodes.
    assert training["ntasks-per-node"] == str(node_placement(cfg).trainer_ranks)
    assert cfg.trainer.num_gpus in (None, s.training_nodes * node_placement(cfg).trainer_ranks)


def test_the_tir_7b_config_renders_as_the_7b_script():
    """configs/qwen7b_tir.yaml has qwen7b_orz.yaml's cluster: its script differs in the names alone."""
    def script(name: str) -> str:
        cfg = load_config(REPO / "configs" / name)
        check_config(cfg)
        return render_script(cfg, f"configs/{name}", [], "pipelinerl-7b", "job.sh")

    tir, orz = script("qwen7b_tir.yaml"), script("qwen7b_orz.yaml")
    assert "learning `math_tir` by RL" in tir and "pipelinerl_main configs/qwen7b_tir.yaml" in tir
    assert tir.replace("qwen7b_tir", "qwen7b_orz").replace("`math_tir`", "`math`") == orz


def test_optional_slurm_fields_reach_every_component():
    cfg = load_config(REPO / "configs/qwen7b_orz.yaml", ["launch.slurm.partition=gpu", "launch.slurm.account=rl",
                                                         "launch.slurm.cpus_per_task=4", "launch.slurm.time=01:00:00"])
    lines = sbatch_lines(cfg, "x")
    assert "#SBATCH --time=01:00:00" in lines
    for component in (lines[-3], lines[-1]):
        assert "--cpus-per-task=4" in component and "--partition=gpu" in component and "--account=rl" in component


def test_overrides_that_lib_sh_would_split_are_refused():
    cfg = load_config(REPO / "configs/tiny_cpu.yaml")
    with pytest.raises(ValueError, match="may not hold spaces"):
        render_script(cfg, "configs/tiny_cpu.yaml", ["run_dir=a b"], "x", "job.sh")


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
    out = subprocess.run([_shellcheck(), "-x", *scripts], check=False, cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout
