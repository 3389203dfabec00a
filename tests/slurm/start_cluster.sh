#!/usr/bin/env bash
# A throw-away Slurm cluster on this one machine, for the Slurm tests (run as root).
#
# Starts munged, MariaDB + slurmdbd (so sacct and submitit can see finished and crashed jobs),
# slurmctld and several slurmd on this host: Slurm's MULTIPLE_SLURMD build lets one host play N
# nodes, and heterogeneous jobs need one node per component (a one-node cluster never starts them).
# Installs Debian's slurm-wlm, slurmdbd, munge and mariadb-server first when they are missing.
# Everything lives under $PIPELINERL_SLURM_STATE; the PIDs of what this script started are in
# $PIPELINERL_SLURM_STATE/pids, which tests/slurm/stop_cluster.sh stops (and nothing else).
#
# Usage:  tests/slurm/start_cluster.sh          then: export SLURM_CONF=$PIPELINERL_SLURM_STATE/slurm.conf
# Environment (optional):
#   PIPELINERL_SLURM_STATE   state folder, wiped at start (default /tmp/pipelinerl-slurm)
#   PIPELINERL_SLURM_NODES   nodes n1..nN (default 4)
#   PIPELINERL_SLURM_CPUS    CPUs each node claims, whatever the machine has (default 4)
#   PIPELINERL_SLURM_PORT    first of the TCP ports used: ctld, dbd, then one per slurmd (default 16800)
#   PIPELINERL_SLURM_TIMEOUT seconds to wait for each daemon (default 60)
set -euo pipefail

STATE="${PIPELINERL_SLURM_STATE:-/tmp/pipelinerl-slurm}"
NODES="${PIPELINERL_SLURM_NODES:-4}"
CPUS="${PIPELINERL_SLURM_CPUS:-4}"
PORT="${PIPELINERL_SLURM_PORT:-16800}"
TIMEOUT="${PIPELINERL_SLURM_TIMEOUT:-60}"
HOST="$(hostname -s)"
started_at=$SECONDS

# shellcheck source=tests/slurm/common.sh
source "$(dirname "$0")/common.sh"

start_slurm() {
    spawn slurmctld slurmctld -D -i
    wait_for slurmctld "$STATE/log/slurmctld.log" scontrol ping
    for i in $(seq 1 "$NODES"); do
        spawn "slurmd-n$i" slurmd -D -N "n$i"
    done
    wait_for "$NODES idle nodes" "$STATE/log/slurmd-n1.log" \
        bash -c "[ \"\$(sinfo -h -t idle -o %D)\" = '$NODES' ]"
}

write_configs() {
    { common_slurm_conf; cat <<EOF; } >"$STATE/slurm.conf"
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 10))
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$((PORT + 1))
NodeName=n[1-$NODES] NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((PORT + 11))-$((PORT + 10 + NODES)) CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    write_slurmdbd_conf 127.0.0.1 $((PORT + 1))
}

main() {
    [ "$(id -u)" -eq 0 ] || die "run as root (the daemons run as root on this throw-away cluster)"
    if [ -d "$STATE/pids" ] && [ -n "$(ls -A "$STATE/pids")" ]; then
        die "a cluster from $STATE is still recorded; run tests/slurm/stop_cluster.sh first"
    fi
    install_missing "${SLURM_PACKAGES[@]}"
    rm -rf "$STATE"
    mkdir -p "$STATE/pids" "$STATE/log" "$STATE/ctld"
    write_configs
    export SLURM_CONF="$STATE/slurm.conf"
    start_munge
    start_mariadb
    start_slurmdbd
    start_slurm
    echo "start_cluster: $NODES nodes up in $((SECONDS - started_at)) s; export SLURM_CONF=$SLURM_CONF"
}

main "$@"
