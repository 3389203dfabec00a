# shellcheck shell=bash
# Shared body of slurm/run_*.sh (sourced by them, not run): resolve the config, the run directory and the
# overrides, then replace the batch shell with the Python launcher (`pipelinerl slurm launch`), so that
# Slurm's --signal=B:USR1 reaches the launcher itself (bash would defer or die of it).
#
# pipelinerl_main DEFAULT_CONFIG [--shape "key=value ..."] [--dry-run] [key=value ...]
#   --shape: the script's own overrides of DEFAULT_CONFIG (node counts, servers per node) that its #SBATCH
#            lines match; PIPELINERL_OVERRIDES and the arguments come after them, so they win.
pipelinerl_main() {
    local default_config="$1" shape=()
    shift
    if [ "${1:-}" = "--shape" ]; then
        read -r -a shape <<<"$2"
        shift 2
    fi
    cd "${PIPELINERL_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}" || return 2
    local python="${PIPELINERL_PYTHON:-python3}"
    local config="${PIPELINERL_CONFIG:-$default_config}"
    # Batch logs are files: no progress bar unless an override asks for one (later overrides win).
    local overrides=(logging.progress_bar=false "${shape[@]}")
    if [ -n "${PIPELINERL_RUN_DIR:-}" ]; then
        overrides+=("run_dir=$PIPELINERL_RUN_DIR")
    fi
    local extra=()
    read -r -a extra <<<"${PIPELINERL_OVERRIDES:-}"
    overrides+=("${extra[@]}")
    if [ "${1:-}" = "--dry-run" ]; then
        shift
        exec "$python" -m pipelinerl.cli slurm launch --dry-run "$config" "${overrides[@]}" "$@"
    fi
    if [ -z "${SLURM_JOB_ID:-}" ]; then
        echo "not inside a Slurm job: submit this script with sbatch, or look at its plan with --dry-run" >&2
        return 2
    fi
    exec "$python" -m pipelinerl.cli slurm launch "$config" "${overrides[@]}" "$@"
}
