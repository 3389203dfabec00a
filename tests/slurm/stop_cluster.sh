#!/usr/bin/env bash
# Stop the throw-away cluster of tests/slurm/start_cluster.sh: cancel its jobs, then stop the daemons it
# recorded in $PIPELINERL_SLURM_STATE/pids (newest first), its hosts' network mounts and the processes that
# hold each host's namespaces, and delete the network namespaces it recorded in $PIPELINERL_SLURM_STATE/netns;
# nothing else. The state folder stays for its logs; the next start wipes it.
#
# Environment (optional): PIPELINERL_SLURM_STATE (default /tmp/pipelinerl-vcluster),
#                         PIPELINERL_SLURM_TIMEOUT seconds to wait for jobs and each daemon (default 60)
set -euo pipefail

STATE="${PIPELINERL_SLURM_STATE:-/tmp/pipelinerl-vcluster}"
TIMEOUT="${PIPELINERL_SLURM_TIMEOUT:-60}"
export SLURM_CONF="$STATE/slurm.conf"
# Slurm's commands run on the cluster's login node (its controller is not reachable from here).
[ -d "$STATE/bin" ] && export PATH="$STATE/bin:$PATH"

# Alive = exists and is not a zombie (this sandbox's PID 1 does not reap, so the dead can linger as Z).
alive() {
    local state
    state="$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" || return 1
    [ -n "$state" ] && [ "$state" != Z ]
}

# Only a PID whose command line still names the daemon we started (PIDs get reused).
ours() {
    local pid="$1" name="$2"
    alive "$pid" && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "${name%%-*}"
}

cancel_jobs() {
    scontrol ping >/dev/null 2>&1 || return 0
    local jobs
    jobs="$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')"
    [ -n "${jobs// /}" ] || return 0
    # shellcheck disable=SC2086  # one job id per word
    scancel $jobs || true
    local deadline=$((SECONDS + TIMEOUT))
    while [ -n "$(squeue -h -o %A 2>/dev/null)" ]; do
        [ $SECONDS -lt $deadline ] || { echo "stop_cluster: jobs still listed after ${TIMEOUT}s: $(squeue -h)" >&2; return 0; }
        sleep 0.5
    done
}

stop_daemon() {
    local pidfile="$1" name pid
    name="$(basename "$pidfile" .pid)"
    pid="$(cat "$pidfile")"
    if ours "$pid" "$name"; then
        kill -TERM "$pid" 2>/dev/null || true
        local deadline=$((SECONDS + TIMEOUT))
        while alive "$pid"; do
            if [ $SECONDS -ge $deadline ]; then
                echo "stop_cluster: $name (pid $pid) ignored SIGTERM for ${TIMEOUT}s; killing it" >&2
                kill -KILL "$pid" 2>/dev/null || true
                break
            fi
            sleep 0.2
        done
    fi
    rm -f "$pidfile"
}

# A host's network mount, unmounted inside its mount namespace (lazily: a process of a dead job may
# still have a file open); sshfs exits with it.
unmount_shared() {
    local pid
    pid="$(cat "$1")"
    if ours "$pid" holder && nsenter --target "$pid" --mount -- mountpoint -q "$STATE/shared"; then
        nsenter --target "$pid" --mount -- fusermount3 -u -z "$STATE/shared" || true
    fi
}

main() {
    [ -d "$STATE/pids" ] || { echo "stop_cluster: no cluster recorded in $STATE"; return 0; }
    cancel_jobs
    local order=(slurmd-* slurmctld slurmdbd mariadbd munged sshd holder-*) pattern pidfile ns
    for pattern in "${order[@]}"; do
        for pidfile in "$STATE/pids/"$pattern.pid; do
            [ -e "$pidfile" ] || continue
            case "$pattern" in holder-*) unmount_shared "$pidfile" ;; esac
            stop_daemon "$pidfile"
        done
    done
    if [ -f "$STATE/netns" ]; then
        while read -r ns; do
            ip netns del "$ns" 2>/dev/null || true
        done <"$STATE/netns"
        rm -f "$STATE/netns"
    fi
    echo "stop_cluster: stopped the cluster of $STATE"
}

main "$@"
