#!/usr/bin/env bash
# Qwen2.5-7B RL on 2 GPU nodes (8 GPUs each) as one heterogeneous Slurm job.
#   component 0, 1 inference node: 8 vLLM servers, one per GPU (srun --het-group=0)
#   component 1, 1 training node:  DeepSpeed ZeRO-3 over its 8 GPUs (a task per GPU) + the actor (srun --het-group=1)
# bf16 weights; after every optimizer step the trainer broadcasts them to the servers over NCCL.
#
# Submit from the repository root, with the Python environment that has pipelinerl active:
#   sbatch [-A ACCOUNT] [-p PARTITION] [-t D-HH:MM:SS] slurm/run_7b.sh [key=value ...]
#   bash slurm/run_7b.sh --dry-run [key=value ...]   # print each role's srun line; submit nothing
# sbatch's -A/-p/-t (or SBATCH_ACCOUNT / SBATCH_PARTITION / SBATCH_TIMELIMIT) apply to both components.
#
# Environment (all optional; sbatch hands your environment to the job):
#   PIPELINERL_CONFIG     config file (default configs/qwen7b_orz.yaml); its launch.slurm node counts and
#                         GPUs per node must match the #SBATCH lines below (the launcher checks)
#   PIPELINERL_RUN_DIR    run directory on the shared filesystem (default: the config's run_dir);
#                         reusing one resumes it
#   PIPELINERL_OVERRIDES  space-separated key=value overrides, applied before the arguments
#   PIPELINERL_PYTHON     Python with pipelinerl installed (default: python3 on PATH)
#   PIPELINERL_HOME       folder relative paths start from (default: the submission folder)
#   NCCL_*, HF_*, ...     reach every role unchanged
#
# Time limit: Slurm sends USR1 300 s before it; the trainer checkpoints after its current step, the job
# requeues itself and resumes from that checkpoint and the stream cursors (no sample lost or repeated).
#
#SBATCH --job-name=pipelinerl-7b
#SBATCH --time=3-12:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --nodes=1 --ntasks-per-node=1 --gpus-per-node=8 --exclusive --mem=0
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks-per-node=8 --gpus-per-node=8 --exclusive --mem=0

# shellcheck source=slurm/lib.sh
source "${PIPELINERL_HOME:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}/slurm/lib.sh"
pipelinerl_main configs/qwen7b_orz.yaml "$@"
