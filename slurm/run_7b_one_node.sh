#!/usr/bin/env bash
# Qwen2.5-7B RL on ONE node of 8 GPUs, split between the roles (the original PipelineRL's everyday shape):
#   GPUs 0-3: 4 vLLM servers, one per GPU          (srun, every GPU of the node, each server picks its own)
#   GPUs 4-7: DeepSpeed ZeRO-3 over 4 ranks + the actor (srun --overlap, each rank picks its own)
# bf16 weights; after every optimizer step the trainer broadcasts them to the servers over NCCL.
# The split is launch.inference_gpus / launch.training_gpus (positions among the node's GPUs); several
# such nodes (--nodes=N here and launch.slurm.training_nodes=N) are each split the same way.
#
# Submit from the repository root, with the Python environment that has pipelinerl active:
#   sbatch [-A ACCOUNT] [-p PARTITION] [-t D-HH:MM:SS] slurm/run_7b_one_node.sh [key=value ...]
#   bash slurm/run_7b_one_node.sh --dry-run [key=value ...]   # print each role's GPUs and srun line
# sbatch's -A/-p/-t (or SBATCH_ACCOUNT / SBATCH_PARTITION / SBATCH_TIMELIMIT) apply.
#
# Environment (all optional; sbatch hands your environment to the job):
#   PIPELINERL_CONFIG     config file (default configs/qwen7b_orz.yaml, shaped by the --shape overrides at
#                         the bottom); its launch.slurm node counts and GPUs per node must match the #SBATCH
#                         lines below (the launcher checks)
#   PIPELINERL_RUN_DIR    run directory on the shared filesystem (default: the config's run_dir);
#                         reusing one resumes it
#   PIPELINERL_OVERRIDES  space-separated key=value overrides, applied before the arguments
#   PIPELINERL_PYTHON     Python with pipelinerl installed (default: python3 on PATH)
#   PIPELINERL_HOME       folder relative paths start from (default: the submission folder)
#   NCCL_*, HF_*, ...     reach every role unchanged
#
# Time limit: Slurm sends USR1 300 s before it; the trainer checkpoints after its current step, the job
# requeues itself and resumes from that checkpoint and the stream cursor (no sample lost or repeated).
#
#SBATCH --job-name=pipelinerl-7b-one-node
#SBATCH --time=3-12:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --nodes=1 --ntasks-per-node=4 --gpus-per-node=8 --exclusive --mem=0

# shellcheck source=slurm/lib.sh
source "${PIPELINERL_HOME:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}/slurm/lib.sh"
pipelinerl_main configs/qwen7b_orz.yaml --shape "launch.slurm.inference_nodes=0 inference.num_servers=4 \
launch.inference_gpus=0-3 launch.training_gpus=4-7 trainer.num_gpus=4" "$@"
