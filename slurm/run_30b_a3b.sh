#!/usr/bin/env bash
# /models/Qwen3-30B-A3B (bfloat16) learning `math` by RL on Slurm; rendered by
#   pipelinerl slurm script --job-name pipelinerl-30b-a3b --path slurm/run_30b_a3b.sh configs/qwen3_30b_a3b.yaml > slurm/run_30b_a3b.sh
# from the config's launch.slurm section: change the config and render again instead of editing it.
#
# component 0 (srun --het-group=0): 1 inference node(s) of 8 GPUs
#   4 vLLM server(s) per node, tensor-parallel over 2 GPU(s) each
# component 1 (srun --het-group=1): 1 training node(s) of 8 GPUs
#   8 trainer rank(s) per node (one GPU each); the actor on the first node
# Weight updates from trainer rank 0 to the servers over nccl.
#
# Submit from the repository root, with the Python environment that has pipelinerl active:
#   sbatch [-A ACCOUNT] [-p PARTITION] [-t D-HH:MM:SS] slurm/run_30b_a3b.sh [key=value ...]
#   bash slurm/run_30b_a3b.sh --dry-run [key=value ...]   # print each role's GPUs and srun line; submit nothing
# sbatch's -A/-p/-t (or SBATCH_ACCOUNT / SBATCH_PARTITION / SBATCH_TIMELIMIT) apply to every component.
#
# Environment (all optional; sbatch hands your environment to the job):
#   PIPELINERL_CONFIG     config file (default configs/qwen3_30b_a3b.yaml);
#                         its launch.slurm node counts and GPUs per node must match the #SBATCH
#                         lines below (the launcher checks)
#   PIPELINERL_RUN_DIR    run directory on the shared filesystem (default: the config's run_dir);
#                         reusing one resumes it
#   PIPELINERL_OVERRIDES  space-separated key=value overrides, applied before the arguments
#   PIPELINERL_PYTHON     Python with pipelinerl installed (default: python3 on PATH)
#   PIPELINERL_HOME       folder relative paths start from (default: the submission folder)
#   NCCL_*, HF_*, ...     reach every role unchanged
#
# Time limit: Slurm sends USR1 300 s before it; the trainer checkpoints after its
# current step, the job requeues itself and resumes from that checkpoint and the stream cursors
# (no sample lost or repeated). The batch log ends with a summary line; trainer rank R logs to
# RUN_DIR/logs/trainer_rankR.log.
#
#SBATCH --job-name=pipelinerl-30b-a3b
#SBATCH --time=3-12:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --nodes=1 --ntasks-per-node=1 --gpus-per-node=8 --exclusive --mem=0
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks-per-node=8 --gpus-per-node=8 --exclusive --mem=0

# shellcheck source=slurm/lib.sh
source "${PIPELINERL_HOME:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}/slurm/lib.sh"
pipelinerl_main configs/qwen3_30b_a3b.yaml "$@"
