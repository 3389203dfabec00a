#!/usr/bin/env bash
# The flagship shape (slurm/run_7b.sh's) with the tiny CPU model, as one heterogeneous Slurm job on CPU
# nodes: what the tests rehearse on a local one-machine cluster (tests/test_slurm.py).
#   component 0, 1 inference node: 2 vLLM-CPU servers (srun --het-group=0)
#   component 1, 2 training nodes: 2 DeepSpeed ranks on CPU (gloo), one per node, + the actor on the
#                                  first (srun --het-group=1)
# Weights go from trainer rank 0 to both servers over gloo after every optimizer step.
#
# Submit from the repository root, with the Python environment that has pipelinerl active:
#   sbatch [-A ACCOUNT] [-p PARTITION] [-t D-HH:MM:SS] slurm/run_tiny_flagship.sh [key=value ...]
#   bash slurm/run_tiny_flagship.sh --dry-run [key=value ...]   # print each role's srun line; submit nothing
# sbatch's -A/-p/-t (or SBATCH_ACCOUNT / SBATCH_PARTITION / SBATCH_TIMELIMIT) apply to both components.
#
# Environment (all optional; sbatch hands your environment to the job):
#   PIPELINERL_CONFIG     config file (default configs/tiny_cpu.yaml, shaped by the --shape overrides at the
#                         bottom); its launch.slurm node counts must match the #SBATCH lines below (the
#                         launcher checks)
#   PIPELINERL_RUN_DIR    run directory on the shared filesystem (default: the config's run_dir);
#                         reusing one resumes it
#   PIPELINERL_OVERRIDES  space-separated key=value overrides, applied before the arguments
#   PIPELINERL_PYTHON     Python with pipelinerl installed (default: python3 on PATH)
#   PIPELINERL_HOME       folder relative paths start from (default: the submission folder)
#
# Time limit: Slurm sends USR1 300 s before it; the trainer checkpoints after its current step, the job
# requeues itself and resumes from that checkpoint and the stream cursor (no sample lost or repeated).
#
#SBATCH --job-name=pipelinerl-tiny-flagship
#SBATCH --time=00:30:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --nodes=1 --ntasks-per-node=1
#SBATCH hetjob
#SBATCH --nodes=2 --ntasks-per-node=1

# shellcheck source=slurm/lib.sh
source "${PIPELINERL_HOME:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}/slurm/lib.sh"
pipelinerl_main configs/tiny_cpu.yaml --shape "inference.num_servers=2 launch.slurm.training_nodes=2" "$@"
