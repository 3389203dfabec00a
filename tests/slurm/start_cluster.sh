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

die() { echo "start_cluster: $*" >&2; exit 1; }

install_missing() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurm-wlm)
    command -v slurmdbd >/dev/null || missing+=(slurmdbd)
    command -v munged >/dev/null || missing+=(munge)
    command -v mariadbd >/dev/null || missing+=(mariadb-server)
    [ ${#missing[@]} -eq 0 ] && return
    [ "$(id -u)" -eq 0 ] || die "needs root to install ${missing[*]}"
    echo "start_cluster: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# Wait until a command succeeds; the message names what was awaited and where its log is.
wait_for() {
    local what="$1" log="$2"; shift 2
    local deadline=$((SECONDS + TIMEOUT))
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -lt $deadline ] || { tail -20 "$log" >&2 || true; die "$what not ready after ${TIMEOUT}s (log: $log)"; }
        sleep 0.2
    done
}

# Start a daemon in the foreground mode of its own session, recording its PID for stop_cluster.sh.
spawn() {
    local name="$1"; shift
    setsid "$@" >>"$STATE/log/$name.out" 2>&1 </dev/null &
    echo $! >"$STATE/pids/$name.pid"
}

start_munge() {
    mkdir -p "$STATE/munge"
    chmod 755 "$STATE/munge"  # munged refuses a socket folder others cannot enter
    mungekey --create --keyfile="$STATE/munge/munge.key" --force
    spawn munged munged --foreground --force --socket="$STATE/munge/munge.socket" \
        --key-file="$STATE/munge/munge.key" --pid-file="$STATE/munge/munged.pid" \
        --seed-file="$STATE/munge/seed" --log-file="$STATE/log/munged.log"
    wait_for munged "$STATE/log/munged.log" bash -c "munge -S '$STATE/munge/munge.socket' -n | unmunge -S '$STATE/munge/munge.socket'"
}

start_mariadb() {
    mariadb-install-db --no-defaults --datadir="$STATE/mysql" --user=root \
        --auth-root-authentication-method=socket >"$STATE/log/mariadb-install.log" 2>&1 \
        || die "mariadb-install-db failed (log: $STATE/log/mariadb-install.log)"
    spawn mariadbd mariadbd --no-defaults --datadir="$STATE/mysql" --socket="$STATE/mysql.sock" \
        --skip-networking --user=root --pid-file="$STATE/mysql.pid" --log-error="$STATE/log/mariadbd.log"
    wait_for mariadbd "$STATE/log/mariadbd.log" mariadb --no-defaults --socket="$STATE/mysql.sock" -e "SELECT 1"
}

start_slurmdbd() {
    # slurmdbd reaches MariaDB over its Unix socket as root (socket authentication, no password).
    MYSQL_UNIX_PORT="$STATE/mysql.sock" spawn slurmdbd slurmdbd -D
    wait_for slurmdbd "$STATE/log/slurmdbd.log" sacctmgr -i list cluster
    sacctmgr -i add cluster pipelinerl >/dev/null
}

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
    local sock="$STATE/munge/munge.socket"
    # cred_expire also sets how long a requeued job waits before it may start again (default 120 s).
    # Backfill (the only scheduler that starts het jobs) runs only after some job or node update; on an
    # idle cluster a requeued job that became eligible waited up to 5 minutes. Pinging the nodes every
    # few seconds (SlurmdTimeout/3) supplies those updates: requeue to restart then took 11-13 s.
    cat >"$STATE/slurm.conf" <<EOF
ClusterName=pipelinerl
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 10))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$sock,cred_expire=10
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/slurmd-%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
SchedulerParameters=bf_interval=1
DependencyParameters=kill_invalid_depend
ReturnToService=2
JobRequeue=1
MpiDefault=none
KillWait=10
SlurmdTimeout=10
MinJobAge=600
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$((PORT + 1))
AccountingStoragePass=$sock
JobAcctGatherType=jobacct_gather/none
NodeName=n[1-$NODES] NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((PORT + 11))-$((PORT + 10 + NODES)) CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$STATE/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$sock
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$((PORT + 1))
SlurmUser=root
PidFile=$STATE/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$STATE/slurmdbd.conf"  # slurmdbd refuses a config others can read
}

main() {
    [ "$(id -u)" -eq 0 ] || die "run as root (the daemons run as root on this throw-away cluster)"
    if [ -d "$STATE/pids" ] && [ -n "$(ls -A "$STATE/pids")" ]; then
        die "a cluster from $STATE is still recorded; run tests/slurm/stop_cluster.sh first"
    fi
    install_missing
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
