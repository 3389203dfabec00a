#!/usr/bin/env bash
# A throw-away multi-host Slurm cluster on this one machine, for the Slurm tests (run as root): every node
# is a host of its own as far as the network, its name and its files go, as on a real cluster.
#
#   head      network namespace $PREFIX-head, address $SUBNET.1 on the bridge br0 (which lives in it):
#             slurmctld, slurmdbd, and the file server (sshd) exporting $SHARED
#   login     $PREFIX-login, $SUBNET.10, hostname vlogin.vcluster.test: where users (and tests) run sbatch,
#             squeue, TensorBoard; the wrappers in $STATE/bin run Slurm's commands there, and
#             `$STATE/bin/on-login COMMAND...` any other
#   vn1..vnN  $PREFIX-vnI, $SUBNET.(10+I), hostname vnI.vcluster.test (fully qualified: not Slurm's
#             NodeName vnI), its own slurmd, its own /dev/shm, and its own /etc/hosts, which maps its own
#             name to 127.0.1.1 as Debian and Ubuntu images do (a process that resolves its own hostname to
#             pick an interface gets loopback); the nodes are named vnI in Slurm (NodeHostname=vnI,
#             NodeAddr=$SUBNET.(10+I))
#
# The node interface on the bridge is `cl0` (not eth0, so nothing may assume its name). Every node and the
# login node mount $SHARED over the network: sshfs from the head's sshd, with directory, attribute and
# negative-lookup caching on ($CACHE_S seconds), so files other hosts write show up late in listings and
# lookups, as on NFS or Lustre. Under $SHARED, on this machine's own filesystem, is the export itself (the
# file server's view); everything else (the repository, its virtual environment, /tmp) every node sees as
# this machine has it. munged and MariaDB (for slurmdbd: sacct and submitit see finished and crashed jobs)
# serve over Unix sockets in $STATE (shared). Installs Debian's slurm-wlm, slurmdbd, munge, mariadb-server,
# sshfs and openssh-server first when they are missing.
#
# It creates network namespaces $PREFIX-*, a bridge and veth pairs inside them, and assigns addresses only
# inside them: this machine's own interfaces and addresses are not touched. tests/slurm/stop_cluster.sh
# stops it (the daemons recorded in $STATE/pids, the mounts, the namespaces recorded in $STATE/netns).
#
# Usage:  tests/slurm/start_cluster.sh     then: export SLURM_CONF=$STATE/slurm.conf PATH=$STATE/bin:$PATH
# Environment (optional):
#   PIPELINERL_SLURM_STATE    state folder, wiped at start (default /tmp/pipelinerl-vcluster)
#   PIPELINERL_SLURM_NODES    nodes vn1..vnN (default 4)
#   PIPELINERL_SLURM_CPUS     CPUs each node claims, whatever the machine has (default 4)
#   PIPELINERL_VCLUSTER_SUBNET first three octets of the bridge's /24 (default 10.213.0)
#   PIPELINERL_VCLUSTER_PREFIX prefix of the namespace names (default plvc)
#   PIPELINERL_VCLUSTER_CACHE_S seconds the network mount caches listings, attributes and lookups (default 2)
#   PIPELINERL_SLURM_TIMEOUT  seconds to wait for each daemon (default 60)
set -euo pipefail

STATE="${PIPELINERL_SLURM_STATE:-/tmp/pipelinerl-vcluster}"
NODES="${PIPELINERL_SLURM_NODES:-4}"
CPUS="${PIPELINERL_SLURM_CPUS:-4}"
SUBNET="${PIPELINERL_VCLUSTER_SUBNET:-10.213.0}"
PREFIX="${PIPELINERL_VCLUSTER_PREFIX:-plvc}"
CACHE_S="${PIPELINERL_VCLUSTER_CACHE_S:-2}"
TIMEOUT="${PIPELINERL_SLURM_TIMEOUT:-60}"
SHARED="$STATE/shared"
DOMAIN=vcluster.test
HEAD="$SUBNET.1"
started_at=$SECONDS

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

holder() { cat "$STATE/pids/holder-$1.pid"; }

# ENTER: the command prefix that runs a command inside host $1's namespaces (network, hostname, and for all
# but the head its mounts).
enter() {
    ENTER=(nsenter --target "$(holder "$1")" --net --uts)
    [ "$1" = head ] || ENTER+=(--mount)
    ENTER+=(--)
}

on() { enter "$1"; shift; "${ENTER[@]}" "$@"; }

node_address() { echo "$SUBNET.$((10 + $1))"; }

# Namespace NAME for host $1, a veth pair into the head's bridge, the address $2 on its end `cl0`.
make_netns() {
    local host="$1" addr="$2" ns="$PREFIX-$1"
    ip netns add "$ns"
    echo "$ns" >>"$STATE/netns"
    ip -n "$ns" link set lo up
    if [ "$host" = head ]; then
        ip -n "$ns" link add br0 type bridge
        ip -n "$ns" addr add "$addr/24" dev br0
        ip -n "$ns" link set br0 up
        return
    fi
    ip link add "v-$host" netns "$PREFIX-head" type veth peer name cl0 netns "$ns"
    ip -n "$PREFIX-head" link set "v-$host" master br0 up
    ip -n "$ns" addr add "$addr/24" dev cl0
    ip -n "$ns" link set cl0 up
}

# /etc/hosts as host $1 (short name $1, fully qualified $1.$DOMAIN) sees it.
hosts_file() {
    local self="$1" i name
    echo "127.0.0.1 localhost"
    echo "127.0.1.1 $self.$DOMAIN $self"
    [ "$self" = vhead ] || echo "$HEAD vhead.$DOMAIN vhead"
    [ "$self" = vlogin ] || echo "$SUBNET.10 vlogin.$DOMAIN vlogin"
    for i in $(seq 1 "$NODES"); do
        name="vn$i"
        [ "$self" = "$name" ] || echo "$(node_address "$i") $name.$DOMAIN $name"
    done
}

start_head() {
    make_netns head "$HEAD"
    # The holder keeps the namespaces; its own name is the hostname slurmctld checks SlurmctldHost against.
    spawn holder-head nsenter --net="/run/netns/$PREFIX-head" unshare --uts -- \
        bash -c 'hostname vhead && exec -a holder-head sleep infinity'
    wait_for "the head's namespaces" "$STATE/log/holder-head.out" bash -c "[ \"\$(nsenter -t \$(cat $STATE/pids/holder-head.pid) --uts hostname)\" = vhead ]"
}

start_file_server() {
    mkdir -p "$STATE/ssh" /run/sshd "$SHARED"
    ssh-keygen -q -t ed25519 -N '' -f "$STATE/ssh/host_key"
    ssh-keygen -q -t ed25519 -N '' -f "$STATE/ssh/client_key"
    cp "$STATE/ssh/client_key.pub" "$STATE/ssh/authorized_keys"
    chmod 600 "$STATE/ssh/authorized_keys"
    cat >"$STATE/ssh/sshd_config" <<EOF
ListenAddress $HEAD
Port 22
HostKey $STATE/ssh/host_key
AuthorizedKeysFile $STATE/ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
MaxStartups 100
MaxSessions 100
Subsystem sftp internal-sftp
EOF
    enter head
    spawn sshd "${ENTER[@]}" /usr/sbin/sshd -D -e -f "$STATE/ssh/sshd_config"
    wait_for sshd "$STATE/log/sshd.out" on head bash -c "exec 3<>/dev/tcp/$HEAD/22"
}

# Host $1 (vlogin or vnI) at address $2: namespaces, its hostname and /etc/hosts, a private /dev/shm for a
# node, and the network mount of $SHARED.
start_host() {
    local host="$1" addr="$2" name="$1" fs_opts
    [ "$host" = login ] && name=vlogin
    make_netns "$host" "$addr"
    hosts_file "$name" >"$STATE/hosts-$host"
    fs_opts="IdentityFile=$STATE/ssh/client_key,StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null"
    fs_opts+=",LogLevel=ERROR,ServerAliveInterval=15,reconnect,dir_cache=yes,dcache_timeout=$CACHE_S"
    fs_opts+=",attr_timeout=$CACHE_S,entry_timeout=$CACHE_S,negative_timeout=$CACHE_S"
    local setup="hostname $name.$DOMAIN && mount --bind $STATE/hosts-$host /etc/hosts"
    [ "$host" = login ] || setup+=" && mount -t tmpfs -o mode=1777 tmpfs /dev/shm"
    setup+=" && sshfs -o $fs_opts root@$HEAD:$SHARED $SHARED && exec -a holder-$host sleep infinity"
    spawn "holder-$host" nsenter --net="/run/netns/$PREFIX-$host" unshare --mount --uts --propagation private -- \
        bash -c "$setup"
    wait_for "the network mount on $host" "$STATE/log/holder-$host.out" \
        bash -c "nsenter -t \$(cat $STATE/pids/holder-$host.pid) --mount -- mountpoint -q $SHARED"
}

write_wrappers() {
    mkdir -p "$STATE/bin"
    local command
    for command in sbatch srun salloc squeue scancel scontrol sinfo sacct sacctmgr; do
        cat >"$STATE/bin/$command" <<EOF
#!/usr/bin/env bash
# $command on the virtual cluster's login node (its network, hostname and mounts), in this folder; on a host
# of the cluster (a job inherits PATH from its submitter), outside the network namespace this was made in,
# the command itself.
if [ "\$(readlink /proc/self/ns/net)" != "$(readlink /proc/self/ns/net)" ]; then
    exec /usr/bin/$command "\$@"
fi
exec nsenter --target "\$(cat $STATE/pids/holder-login.pid)" --net --uts --mount -- \\
    bash -c 'cd "\$1" && shift && exec "\$@"' cd "\$PWD" /usr/bin/$command "\$@"
EOF
        chmod 755 "$STATE/bin/$command"
    done
    cat >"$STATE/bin/on-login" <<EOF
#!/usr/bin/env bash
# on-login COMMAND [ARG...]: run a command on the virtual cluster's login node, in this folder.
exec nsenter --target "\$(cat $STATE/pids/holder-login.pid)" --net --uts --mount -- \\
    bash -c 'cd "\$1" && shift && exec "\$@"' cd "\$PWD" "\$@"
EOF
    chmod 755 "$STATE/bin/on-login"
}

write_configs() {
    { common_slurm_conf; cat <<EOF; } >"$STATE/slurm.conf"
SlurmctldHost=vhead($HEAD)
AccountingStorageHost=$HEAD
NodeName=vn[1-$NODES] NodeHostname=vn[1-$NODES] NodeAddr=$SUBNET.[11-$((10 + NODES))] CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    write_slurmdbd_conf "$HEAD" 6819
}

start_slurm() {
    enter head
    spawn slurmctld "${ENTER[@]}" slurmctld -D -i
    wait_for slurmctld "$STATE/log/slurmctld.log" on login scontrol ping
    local i
    for i in $(seq 1 "$NODES"); do
        enter "vn$i"
        spawn "slurmd-vn$i" "${ENTER[@]}" slurmd -D -N "vn$i"
    done
    wait_for "$NODES idle nodes" "$STATE/log/slurmd-vn1.log" \
        bash -c "[ \"\$('$STATE/bin/sinfo' -h -t idle -o %D)\" = '$NODES' ]"
}

main() {
    [ "$(id -u)" -eq 0 ] || die "run as root (namespaces, mounts and the daemons of this throw-away cluster)"
    if [ -d "$STATE/pids" ] && [ -n "$(ls -A "$STATE/pids")" ]; then
        die "a cluster from $STATE is still recorded; run tests/slurm/stop_cluster.sh first"
    fi
    install_missing "${SLURM_PACKAGES[@]}" sshfs:sshfs sshd:openssh-server nsenter:util-linux
    local ns
    for ns in $(ip netns list | awk '{print $1}' | grep "^$PREFIX-" || true); do
        ip netns del "$ns"  # left by a run that was killed before it could stop
    done
    rm -rf "$STATE"
    mkdir -p "$STATE/pids" "$STATE/log" "$STATE/ctld"
    : >"$STATE/netns"
    write_configs
    write_wrappers
    export SLURM_CONF="$STATE/slurm.conf"
    start_munge
    start_mariadb
    start_head
    start_file_server
    start_host login "$SUBNET.10"
    local i
    for i in $(seq 1 "$NODES"); do
        start_host "vn$i" "$(node_address "$i")"
    done
    enter head
    MYSQL_UNIX_PORT="$STATE/mysql.sock" spawn slurmdbd "${ENTER[@]}" slurmdbd -D
    wait_for slurmdbd "$STATE/log/slurmdbd.log" on login sacctmgr -i list cluster
    on login sacctmgr -i add cluster pipelinerl >/dev/null
    start_slurm
    echo "start_cluster: $NODES nodes up in $((SECONDS - started_at)) s;" \
        "export SLURM_CONF=$SLURM_CONF PATH=$STATE/bin:\$PATH; run directories under $SHARED"
}

main "$@"
