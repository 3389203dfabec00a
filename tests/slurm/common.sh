# shellcheck shell=bash
# Shared by tests/slurm/start_cluster.sh (one host) and start_vcluster.sh (a multi-host virtual cluster):
# installing what is missing, waiting for daemons, munged, MariaDB and slurmdbd. Sourced, not run; the
# caller sets STATE (the state folder) and TIMEOUT (seconds to wait for each daemon).

die() { echo "$(basename "$0"): $*" >&2; exit 1; }

# Install Debian packages for the commands that are missing: "command:package" pairs.
install_missing() {
    local pair missing=()
    for pair in "$@"; do
        command -v "${pair%%:*}" >/dev/null || missing+=("${pair#*:}")
    done
    [ ${#missing[@]} -eq 0 ] && return
    [ "$(id -u)" -eq 0 ] || die "needs root to install ${missing[*]}"
    echo "$(basename "$0"): installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

SLURM_PACKAGES=(slurmctld:slurm-wlm slurmdbd:slurmdbd munged:munge mariadbd:mariadb-server)

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

# slurmdbd (run by the command prefix given, e.g. one that enters a namespace) reaches MariaDB over its
# Unix socket as root (socket authentication, no password).
start_slurmdbd() {
    MYSQL_UNIX_PORT="$STATE/mysql.sock" spawn slurmdbd "$@" slurmdbd -D
    wait_for slurmdbd "$STATE/log/slurmdbd.log" sacctmgr -i list cluster
    sacctmgr -i add cluster pipelinerl >/dev/null
}

# slurmdbd.conf: DBD_ADDR is the address slurmdbd listens on, DBD_PORT its port.
write_slurmdbd_conf() {
    local addr="$1" port="$2"
    cat >"$STATE/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$STATE/munge/munge.socket
DbdHost=localhost
DbdAddr=$addr
DbdPort=$port
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

# The slurm.conf lines both clusters share (the caller adds hosts, ports and nodes).
common_slurm_conf() {
    # cred_expire also sets how long a requeued job waits before it may start again (default 120 s).
    # Backfill (the only scheduler that starts het jobs) runs only after some job or node update; on an
    # idle cluster a requeued job that became eligible waited up to 5 minutes. Pinging the nodes every
    # few seconds (SlurmdTimeout/3) supplies those updates: requeue to restart then took 11-13 s.
    cat <<EOF
ClusterName=pipelinerl
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$STATE/munge/munge.socket,cred_expire=10
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
AccountingStoragePass=$STATE/munge/munge.socket
JobAcctGatherType=jobacct_gather/none
EOF
}
