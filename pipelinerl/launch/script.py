"""`pipelinerl slurm script CONFIG [key=value ...]`: the sbatch script of a config, rendered from its
`launch.slurm` section, so node, task and GPU counts have one home (the config) instead of also living in
hand-kept #SBATCH lines. The shipped slurm/run_*.sh are such renderings: each names the command that
made it, and tests/test_launch_script.py renders each again and compares byte for byte.

The script's body is slurm/lib.sh's `pipelinerl_main`, which execs `pipelinerl slurm launch` with the
same config and overrides (its "shape"), so the job and its #SBATCH lines agree.

Rendered #SBATCH lines (per component: inference nodes, then after `hetjob` training nodes; one
component when colocated, launch.slurm.inference_nodes = 0):
  job        --job-name, --time, --signal=B:USR1@signal_seconds, --requeue, --open-mode=append
  component  --nodes, --ntasks-per-node (1 servers agent on inference nodes; one task per trainer rank on
             training nodes), --gpus-per-node and --exclusive (whole GPU nodes: placement counts the
             node's GPUs from 0), --cpus-per-task, --mem, --partition, --account, --qos when set
"""

from __future__ import annotations

import shlex

from pipelinerl.config import Config
from pipelinerl.launch.commands import slot_names
from pipelinerl.launch.slurm_node import colocated, node_placement


def sbatch_lines(cfg: Config, job_name: str) -> list[str]:
    """The #SBATCH lines of the config's job (a heterogeneous one unless colocated)."""
    s = cfg.launch.slurm
    lines = [f"#SBATCH --job-name={job_name}", f"#SBATCH --time={s.time}",
             f"#SBATCH --signal=B:USR1@{s.signal_seconds}", "#SBATCH --requeue", "#SBATCH --open-mode=append"]
    training = _component(cfg, s.training_nodes, node_placement(cfg).trainer_ranks)
    if colocated(cfg):
        return [*lines, training]
    return [*lines, _component(cfg, s.inference_nodes, 1), "#SBATCH hetjob", training]


def _component(cfg: Config, nodes: int, tasks_per_node: int) -> str:
    s = cfg.launch.slurm
    opts = [f"--nodes={nodes}", f"--ntasks-per-node={tasks_per_node}"]
    if s.gpus_per_node is not None:
        opts += [f"--gpus-per-node={s.gpus_per_node}", "--exclusive"]
    for flag, value in (("cpus-per-task", s.cpus_per_task), ("mem", s.mem), ("partition", s.partition),
                        ("account", s.account), ("qos", s.qos)):
        if value is not None:
            opts.append(f"--{flag}={value}")
    return "#SBATCH " + " ".join(opts)


def _shape(cfg: Config) -> list[str]:
    """Comment lines: which nodes run what."""
    s, inf, placed = cfg.launch.slurm, cfg.inference, node_placement(cfg)
    gpus = "" if s.gpus_per_node is None else f" of {s.gpus_per_node} GPUs"
    if colocated(cfg):
        return [f"{s.training_nodes} node(s){gpus}, each split between the roles (every step asks for all the node's",
                "GPUs and each server / trainer rank picks its own; the actor runs on the first node):",
                *(f"  {line}" for line in placed.describe(slot_names(cfg, side=True)))]
    where = "on CPU (gloo)" if placed.trainer_gpus is None else "one GPU each"
    return [f"component 0 (srun --het-group=0): {s.inference_nodes} inference node(s){gpus}",
            f"  {inf.num_servers} vLLM server(s) per node, tensor-parallel over {inf.tensor_parallel_size} GPU(s) each",
            f"component 1 (srun --het-group=1): {s.training_nodes} training node(s){gpus}",
            f"  {placed.trainer_ranks} trainer rank(s) per node ({where}); the actor on the first node"]


def render_script(cfg: Config, config: str, overrides: list[str], job_name: str, path: str) -> str:
    """The whole script for `config` + `overrides` (cfg: them loaded), saved at `path`."""
    for item in overrides:
        if any(c.isspace() or c in "\"'\\$`" for c in item):
            raise ValueError(f"override {item!r}: a script's overrides may not hold spaces, quotes, `\\`, `$` or "
                             "backticks (slurm/lib.sh splits them on spaces)")
    command = ["pipelinerl", "slurm", "script", "--job-name", job_name, "--path", path, config, *overrides]
    shaped = ", shaped by the overrides on the last line" if overrides else ""
    s = cfg.launch.slurm
    lines = ["#!/usr/bin/env bash",
             f"# {cfg.model.path} ({cfg.model.dtype}) learning `{cfg.task.name}` by RL on Slurm; rendered by",
             f"#   {shlex.join(command)} > {path}",
             "# from the config's launch.slurm section: change the config and render again instead of editing it.",
             "#", *(f"# {line}" for line in _shape(cfg)),
             f"# Weight updates from trainer rank 0 to the servers over {cfg.inference.weight_update_backend}.",
             "#",
             "# Submit from the repository root, with the Python environment that has pipelinerl active:",
             f"#   sbatch [-A ACCOUNT] [-p PARTITION] [-t D-HH:MM:SS] {path} [key=value ...]",
             f"#   bash {path} --dry-run [key=value ...]   # print each role's GPUs and srun line; submit nothing",
             "# sbatch's -A/-p/-t (or SBATCH_ACCOUNT / SBATCH_PARTITION / SBATCH_TIMELIMIT) apply to every component.",
             "#",
             "# Environment (all optional; sbatch hands your environment to the job):",
             f"#   PIPELINERL_CONFIG     config file (default {config}{shaped});",
             "#                         its launch.slurm node counts and GPUs per node must match the #SBATCH",
             "#                         lines below (the launcher checks)",
             "#   PIPELINERL_RUN_DIR    run directory on the shared filesystem (default: the config's run_dir);",
             "#                         reusing one resumes it",
             "#   PIPELINERL_OVERRIDES  space-separated key=value overrides, applied before the arguments",
             "#   PIPELINERL_PYTHON     Python with pipelinerl installed (default: python3 on PATH)",
             "#   PIPELINERL_HOME       folder relative paths start from (default: the submission folder)",
             "#   NCCL_*, HF_*, ...     reach every role unchanged",
             "#",
             f"# Time limit: Slurm sends USR1 {s.signal_seconds} s before it; the trainer checkpoints after its",
             "# current step, the job requeues itself and resumes from that checkpoint and the stream cursors",
             "# (no sample lost or repeated). The batch log ends with a summary line; trainer rank R logs to",
             "# RUN_DIR/logs/trainer_rankR.log.",
             "#", *sbatch_lines(cfg, job_name), "",
             "# shellcheck source=slurm/lib.sh",
             'source "${PIPELINERL_HOME:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}/slurm/lib.sh"']
    shape = f' --shape "{" ".join(overrides)}"' if overrides else ""
    lines.append(f'pipelinerl_main {shlex.quote(config)}{shape} "$@"')
    return "\n".join(lines) + "\n"
