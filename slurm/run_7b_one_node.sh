#!/usr/bin/env bash
# /models/Qwen2.5-7B (bfloat16) learning `math` by RL on Slurm; rendered by
#   pipelinerl slurm script --job-name pipelinerl-7b-one-node --path slurm/run_7b_one_node.sh configs/qwen7b_orz.yaml launch.slurm.inference_nodes=0 inference.num_servers=4 launch.inference_gpus=0-3 launch.training_gpus=4-7 trainer.num_gpus=4 > slurm/run_7b_one_node.sh
# from the config's launch.slurm section: change the config and render again instead of editing it.
#
# 1 node(s) of 8 GPUs, each split between the roles (every step asks for all the node's
# GPUs and each server / trainer rank picks its own; the actor runs on the first node):
#   server0: GPUs 0
#   server1: GPUs 1
#   server2: GPUs 2
#   server3: GPUs 3
#   trainer: 4 rank(s) on GPUs 4,5,6,7
# Weight updates from trainer rank 0 to the servers over nccl.
#
# Submit from the repository root, with the Python environment that has pipelinerl active:
#   sbatch [-A ACCOUNT] [-p PARTITION] [-t D-HH:MM:SS] slurm/run_7b_one_node.sh [key=value ...]
#   bash slurm/run_7b_one_node.sh --dry-run [key=value ...]   # print each role's GPUs and srun line; submit nothing
# sbatch's -A/-p/-t (or SBATCH_ACCOUNT / SBATCH_PARTITION / SBATCH_TIMELIMIT) apply to every component.
#
# Environment (all optional; sbatch hands your environment to the job):
#   PIPELINERL_CONFIG     config file (default configs/qwen7b_orz.yaml, shaped by the overrides on the last line);
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
#SBATCH --job-name=pipelinerl-7b-one-node
#SBATCH --time=3-12:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --nodes=1 --ntasks-per-node=4 --gpus-per-node=8 --exclusive --mem=0

# shellcheck source=slurm/lib.sh
source "${PIPELINERL_HOME:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}/slurm/lib.sh"
pipelinerl_main configs/qwen7b_orz.yaml --shape "launch.slurm.inference_nodes=0 inference.num_servers=4 launch.inference_gpus=0-3 launch.training_gpus=4-7 trainer.num_gpus=4" "$@"
