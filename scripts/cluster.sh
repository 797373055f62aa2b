#!/usr/bin/env bash
# A real SLURM cluster on this one machine: a controller and N compute nodes, each node a network namespace
# with its own address on a private bridge, its own hostname, slurmd, sshd (for DeepSpeed's pdsh launcher)
# and node-local folder; one shared folder for results and checkpoints. The one place that knows how.
#
#   scripts/cluster.sh up [N]          controller + N nodes (default 3, at least 2); again: nothing to do
#   scripts/cluster.sh down            stop every daemon, remove namespaces, links and the state folder
#   scripts/cluster.sh status          what is up, and sinfo
#   scripts/cluster.sh env             the variables a shell needs to use the cluster (eval "$(... env)")
#   scripts/cluster.sh exec NODE CMD   run CMD on NODE (in its network, mount and hostname namespaces)
#   scripts/cluster.sh lose NODE kill  every process of NODE killed (slurmd, its job steps and ranks, sshd)
#   scripts/cluster.sh lose NODE link  NODE's link taken down: its processes run on, unreachable
#   scripts/cluster.sh revive NODE     link up, slurmd and sshd started again, node returned to service
#
# Exit codes: 0 done; 1 failed (the message says where to look); 2 usage; 3 this machine cannot hold the
# cluster (a package, root or a kernel feature is missing: the message says which), so tests skip on 3 only.
#
# Layout (AIDAPTIV_CLUSTER_DIR, default /var/tmp/aidaptiv-cluster; on a disk that takes O_DIRECT, not tmpfs):
#   slurm.conf, hosts, cluster.env      the cluster's configuration (SLURM_CONF points at slurm.conf)
#   shared/                             the shared folder: every node sees the same files (results, checkpoints)
#   local/                              the node-local folder: the same path on every node, but each node's
#                                       mount namespace binds nodes/<node>/local/ there (swap space)
#   nodes/<node>/                       spool, logs and pid files of the node's daemons, and its local/
#   ctl/, munge/, ssh/                  the controller's state and log, munged's key and socket, ssh keys
# Addresses: 10.231.0.0/24 (AIDAPTIV_CLUSTER_NET=10.231.0): .1 this machine (the login node: sbatch, srun,
# scontrol run here with SLURM_CONF set), .2 the controller "ctl", .11 onward node1, node2, ... No route
# leaves the bridge: traffic between nodes stays on these private addresses and loopback.
#
# What makes it work in this VM: proctrack/linuxproc and task/none (no cgroup plugin: the VM's cgroups are
# not ours to manage), accounting off, one munged for the whole cluster on its own key and socket (a path
# socket is reachable from every network namespace), the nodes' names in a hosts file bound over /etc/hosts
# inside their mount namespaces only (this machine's /etc is not changed), and an ssh client config bound
# over /etc/ssh/ssh_config there that uses the generated key. slurmctld, slurmd and the job steps run as
# root (SlurmUser=root), as everything here does: acceptable for a throwaway test cluster whose only user
# is root and whose network is a private bridge; a real cluster runs slurmctld as the slurm user and steps
# as the submitting user.
set -euo pipefail

D=${AIDAPTIV_CLUSTER_DIR:-/var/tmp/aidaptiv-cluster}
NET=${AIDAPTIV_CLUSTER_NET:-10.231.0}
PREFIX=aidc                 # namespaces aidc-ctl, aidc-node<k>; host-side links aidc-v<k>, bridge aidc-br
BRIDGE=$PREFIX-br
SLURMD_TIMEOUT=${AIDAPTIV_CLUSTER_SLURMD_TIMEOUT:-30}

say() { echo "cluster: $*" >&2; }
die() {
    echo "cluster: $*" >&2
    exit 1
}

nodes_up() { ip netns list 2>/dev/null | sed -n "s/^$PREFIX-\(node[0-9]*\).*/\1/p" | sort -V; }
node_ns() { echo "$PREFIX-$1"; }
node_index() { echo "${1#node}"; }
holder() { cat "$D/nodes/$1/holder.pid" 2>/dev/null || true; }
alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }
pid_of() { cat "$1" 2>/dev/null || true; }

# What is missing, all at once: commands (with the Debian package that brings each), root, and the kernel's
# network namespaces and veth pairs.
check_requirements() {
    local missing=() cmd pkg
    for pair in ip:iproute2 unshare:util-linux nsenter:util-linux setsid:util-linux flock:util-linux \
        slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client srun:slurm-client scontrol:slurm-client \
        sinfo:slurm-client munged:munge sshd:openssh-server ssh-keygen:openssh-client ssh:openssh-client \
        pdsh:pdsh; do
        cmd=${pair%%:*} pkg=${pair#*:}
        command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || missing+=("$cmd (apt-get install $pkg)")
    done
    [ "$(id -u)" -eq 0 ] || missing+=("root: namespaces, links and daemons need it (run as root)")
    if [ ${#missing[@]} -gt 0 ]; then
        printf 'cluster: missing: %s\n' "${missing[@]}" >&2
        return 1
    fi
    local probe=$PREFIX-probe$$
    if ! ip netns add "$probe" 2>/dev/null; then
        say "missing: network namespaces (ip netns add failed: the kernel or this container does not allow them)"
        return 1
    fi
    if ! ip link add "$probe" type veth peer name eth0 netns "$probe" 2>/dev/null; then
        ip netns del "$probe"
        say "missing: veth pairs (ip link add type veth failed: the kernel lacks CONFIG_VETH)"
        return 1
    fi
    ip link del "$probe" 2>/dev/null || true
    ip netns del "$probe"
    if ! ip link add "$PREFIX-brprobe" type bridge 2>/dev/null; then
        say "missing: bridges (ip link add type bridge failed: the kernel lacks CONFIG_BRIDGE)"
        return 1
    fi
    ip link del "$PREFIX-brprobe"
}

write_config() {
    local n=$1 k
    mkdir -p "$D"/{shared,local,ctl/state,munge,ssh}
    chmod 700 "$D/munge" "$D/ssh"
    chmod 1777 "$D/shared"
    {
        echo "127.0.0.1 localhost"
        echo "$NET.1 login"
        echo "$NET.2 ctl"
        for k in $(seq 1 "$n"); do echo "$NET.$((10 + k)) node$k"; done
    } >"$D/hosts"
    cat >"$D/slurm.conf" <<EOF
# Written by scripts/cluster.sh: a test cluster on one machine (see the script's comments).
ClusterName=aidaptiv
SlurmctldHost=ctl($NET.2)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$D/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$D/ctl/state
SlurmctldPidFile=$D/ctl/slurmctld.pid
SlurmctldLogFile=$D/ctl/slurmctld.log
SlurmdSpoolDir=$D/nodes/%n/spool
SlurmdPidFile=$D/nodes/%n/slurmd.pid
SlurmdLogFile=$D/nodes/%n/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
ReturnToService=2
# A node that stops answering is marked DOWN after this long, and its jobs end (NODE_FAIL).
SlurmdTimeout=$SLURMD_TIMEOUT
SlurmctldTimeout=30
MessageTimeout=10
InactiveLimit=0
KillWait=5
MinJobAge=600
# A rank that exits non-zero ends its whole step (its peers would wait for it otherwise).
KillOnBadExit=1
PropagateResourceLimits=NONE
NodeName=DEFAULT CPUs=2 RealMemory=$((7 * 1024)) State=UNKNOWN
EOF
    for k in $(seq 1 "$n"); do
        echo "NodeName=node$k NodeHostname=node$k NodeAddr=$NET.$((10 + k))" >>"$D/slurm.conf"
    done
    echo "PartitionName=cpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >>"$D/slurm.conf"
    cat >"$D/cluster.env" <<EOF
export SLURM_CONF=$D/slurm.conf
export AIDAPTIV_CLUSTER_DIR=$D
export AIDAPTIV_CLUSTER_SHARED=$D/shared
export AIDAPTIV_CLUSTER_LOCAL=$D/local
EOF
}

start_munge() {
    [ -f "$D/munge/munge.key" ] || {
        dd if=/dev/urandom of="$D/munge/munge.key" bs=1024 count=1 status=none
        chmod 400 "$D/munge/munge.key"
    }
    alive "$(pid_of "$D/munge/munged.pid")" && return
    munged --force --key-file="$D/munge/munge.key" --socket="$D/munge/munge.socket" \
        --pid-file="$D/munge/munged.pid" --log-file="$D/munge/munged.log" --seed-file="$D/munge/munged.seed" 9<&-
}

write_ssh() {
    local s=$D/ssh
    [ -f "$s/id_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -C aidaptiv-cluster -f "$s/id_ed25519"
    [ -f "$s/host_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -C aidaptiv-cluster-host -f "$s/host_ed25519"
    cp "$s/id_ed25519.pub" "$s/authorized_keys"
    chmod 600 "$s/authorized_keys"
    # The client config the nodes see as /etc/ssh/ssh_config: the generated key, no host key prompts (the
    # nodes' host key is made here and changes with every cluster).
    cat >"$s/ssh_config" <<EOF
Host *
    IdentityFile $s/id_ed25519
    IdentitiesOnly yes
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    LogLevel ERROR
    BatchMode yes
EOF
    # StrictModes off: the key files sit under /var/tmp, which is world-writable (sticky).
    cat >"$s/sshd_config" <<EOF
Port 22
HostKey $s/host_ed25519
AuthorizedKeysFile $s/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
AcceptEnv LANG LC_*
EOF
    # sshd's privilege-separation folder (made by its service on a normal boot); removed by down if made here.
    if [ ! -d /run/sshd ]; then
        mkdir -p /run/sshd && chmod 755 /run/sshd && touch "$D/made-run-sshd"
    fi
}

# Every daemon is started with the lock's descriptor (9) closed: one that kept it would hold the lock for its
# whole life.
# A namespace with its own network, hostname and mounts, held by a sleeping process whose pid is saved;
# daemons enter it with nsenter. The binds live in that mount namespace only and vanish with it.
make_host_ns() {
    local name=$1 addr=$2 dir=$3 link=$4 binds=$5
    local ns=$PREFIX-$name
    ip netns add "$ns"
    ip link add "$link" type veth peer name eth0 netns "$ns"
    ip link set "$link" master "$BRIDGE" up
    ip -n "$ns" addr add "$addr/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    mkdir -p "$dir"
    rm -f "$dir/holder.pid"
    # nsenter, not 'ip netns exec': that one mounts a sysfs of its own over /sys, which hides the cgroup
    # hierarchy slurmd reads at start ("No filesystem mounted on /sys/fs/cgroup").
    setsid -f nsenter --net="/run/netns/$ns" unshare --mount --uts --propagation private sh -c "
        hostname $name
        mount --bind $D/hosts /etc/hosts
        mount --bind $D/ssh/ssh_config /etc/ssh/ssh_config
        $binds
        echo \$\$ > $dir/holder.pid
        exec sleep infinity" </dev/null >"$dir/holder.log" 2>&1 9<&-
    for _ in $(seq 1 50); do
        [ -s "$dir/holder.pid" ] && return
        sleep 0.1
    done
    die "the namespace of $name did not start: $(cat "$dir/holder.log")"
}

in_node() { # in_node NODE CMD...: run CMD inside NODE's namespaces
    local h
    h=$(holder "$1")
    alive "$h" || die "node $1 is not up (no namespace holder): run '$0 up' or '$0 revive $1'"
    shift
    nsenter --target "$h" --net --mount --uts -- "$@" 9<&-
}

start_node_daemons() {
    local node=$1
    local dir=$D/nodes/$node
    mkdir -p "$dir/spool" "$dir/local"
    chmod 700 "$dir/local"
    alive "$(pid_of "$dir/sshd.pid")" ||
        in_node "$node" /usr/sbin/sshd -f "$D/ssh/sshd_config" -o "PidFile=$dir/sshd.pid" -E "$dir/sshd.log"
    alive "$(pid_of "$dir/slurmd.pid")" || in_node "$node" env SLURM_CONF="$D/slurm.conf" slurmd -f "$D/slurm.conf"
}

up() {
    local n=${1:-3}
    [[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 2 ] || die "up N: N is the number of compute nodes, at least 2 (got '$n')"
    check_requirements || exit 3
    if healthy "$n"; then
        say "already up: controller and $n nodes in $D (SLURM_CONF=$D/slurm.conf)"
        return
    fi
    if [ -n "$(ip netns list 2>/dev/null | grep "^$PREFIX-" || true)" ] || [ -d "$D" ]; then
        say "a partial or different cluster is there: taking it down first"
        down
    fi
    say "bringing up a controller and $n nodes in $D"
    write_config "$n"
    write_ssh
    start_munge
    ip link add "$BRIDGE" type bridge
    ip addr add "$NET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    make_host_ns ctl "$NET.2" "$D/ctl" "$PREFIX-vctl" ""
    in_node_ctl env SLURM_CONF="$D/slurm.conf" slurmctld -f "$D/slurm.conf"
    local k
    for k in $(seq 1 "$n"); do
        mkdir -p "$D/nodes/node$k/local"
        make_host_ns "node$k" "$NET.$((10 + k))" "$D/nodes/node$k" "$PREFIX-v$k" \
            "mount --bind $D/nodes/node$k/local $D/local"
        start_node_daemons "node$k"
    done
    wait_idle "$n" 60 || {
        status >&2
        die "the nodes did not come up in 60 s: see $D/ctl/slurmctld.log and $D/nodes/*/slurmd.log"
    }
    say "up: $n nodes idle; use it with: eval \"\$($0 env)\" (SLURM_CONF=$D/slurm.conf)"
}

in_node_ctl() {
    local h
    h=$(pid_of "$D/ctl/holder.pid")
    nsenter --target "$h" --net --mount --uts -- "$@" 9<&-
}

wait_idle() { # wait_idle N SECONDS: every node answers and is idle
    local n=$1 secs=$2 i
    for i in $(seq 1 $((secs * 2))); do
        if [ "$(SLURM_CONF=$D/slurm.conf sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle$')" -eq "$n" ]; then
            return 0
        fi
        sleep 0.5
    done
    return 1
}

healthy() {
    local n=$1 k
    [ -f "$D/slurm.conf" ] || return 1
    alive "$(pid_of "$D/munge/munged.pid")" || return 1
    alive "$(pid_of "$D/ctl/slurmctld.pid")" || return 1
    [ "$(nodes_up | wc -l)" -eq "$n" ] || return 1
    for k in $(seq 1 "$n"); do
        alive "$(holder "node$k")" && alive "$(pid_of "$D/nodes/node$k/slurmd.pid")" &&
            alive "$(pid_of "$D/nodes/node$k/sshd.pid")" || return 1
    done
}

kill_netns_procs() { # every process in a network namespace: TERM, then KILL after 5 s
    local ns=$1 pids i
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -n "$pids" ] || return 0
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null || true
    for i in $(seq 1 50); do
        [ -z "$(ip netns pids "$ns" 2>/dev/null || true)" ] && return 0
        sleep 0.1
    done
    # shellcheck disable=SC2046
    kill -KILL $(ip netns pids "$ns" 2>/dev/null || true) 2>/dev/null || true
    sleep 0.2
}

down() {
    local ns
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$PREFIX-" || true); do
        kill_netns_procs "$ns"
        ip netns del "$ns" 2>/dev/null || true
    done
    local link
    for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep "^$PREFIX-" || true); do
        ip link del "$link" 2>/dev/null || true
    done
    local m
    m=$(pid_of "$D/munge/munged.pid")
    if alive "$m"; then
        kill "$m" 2>/dev/null || true
        for _ in $(seq 1 50); do alive "$m" || break; sleep 0.1; done
    fi
    if [ -n "$(findmnt -rn -o TARGET | grep "^$D" || true)" ]; then
        die "mounts under $D are still there (findmnt): not removing it"
    fi
    if [ -f "$D/made-run-sshd" ]; then rmdir /run/sshd 2>/dev/null || true; fi
    rm -rf "$D"
    say "down: no namespaces, links, daemons or state left"
}

status() {
    if ! alive "$(pid_of "$D/ctl/slurmctld.pid")"; then
        echo "cluster: down (no controller in $D)"
        [ -z "$(ip netns list 2>/dev/null | grep "^$PREFIX-" || true)" ] ||
            echo "cluster: namespaces left over: $(ip netns list | grep "^$PREFIX-" | awk '{print $1}' | xargs); run: $0 down"
        return 1
    fi
    echo "cluster: controller ctl ($NET.2), munged $(alive "$(pid_of "$D/munge/munged.pid")" && echo up || echo DOWN)"
    local node
    for node in $(nodes_up); do
        local dir=$D/nodes/$node
        printf 'cluster: %s %s link %s, slurmd %s, sshd %s, local folder %s\n' "$node" \
            "$NET.$((10 + $(node_index "$node")))" \
            "$(ip -o link show "$PREFIX-v$(node_index "$node")" 2>/dev/null | grep -q 'state UP' && echo up || echo DOWN)" \
            "$(alive "$(pid_of "$dir/slurmd.pid")" && echo up || echo DOWN)" \
            "$(alive "$(pid_of "$dir/sshd.pid")" && echo up || echo DOWN)" "$dir/local"
    done
    SLURM_CONF=$D/slurm.conf sinfo -N -o '%N %t %c %m %E' || true
}

lose() {
    local node=$1 how=$2
    [ -d "$D/nodes/$node" ] || die "no node $node in $D"
    case $how in
    kill)
        # A node that dies: every process on it, the namespace holder excepted (its mounts keep the node's
        # local folder in place for a revive).
        local h pids p
        h=$(holder "$node")
        pids=$(ip netns pids "$(node_ns "$node")" 2>/dev/null || true)
        for p in $pids; do [ "$p" = "$h" ] || kill -KILL "$p" 2>/dev/null || true; done
        say "$node: every process killed (slurmd, job steps, ranks, sshd)"
        ;;
    link)
        ip link set "$PREFIX-v$(node_index "$node")" down
        say "$node: link down (its processes run on, unreachable)"
        ;;
    *) die "lose NODE kill|link (got '$how')" ;;
    esac
}

revive() {
    local node=$1
    [ -d "$D/nodes/$node" ] || die "no node $node in $D"
    ip link set "$PREFIX-v$(node_index "$node")" up
    # What ran there before the loss (ranks blocked on a peer that vanished) goes, as on a rebooted node.
    local h pids p
    h=$(holder "$node")
    pids=$(ip netns pids "$(node_ns "$node")" 2>/dev/null || true)
    for p in $pids; do [ "$p" = "$h" ] || kill -KILL "$p" 2>/dev/null || true; done
    sleep 0.2
    rm -f "$D/nodes/$node/slurmd.pid" "$D/nodes/$node/sshd.pid"
    start_node_daemons "$node"
    SLURM_CONF=$D/slurm.conf scontrol update NodeName="$node" State=RESUME 2>/dev/null || true
    for _ in $(seq 1 60); do
        SLURM_CONF=$D/slurm.conf sinfo -h -n "$node" -o '%t' | grep -q '^idle$' && {
            say "$node: back in service"
            return
        }
        sleep 0.5
    done
    die "$node did not return to service in 30 s: see $D/nodes/$node/slurmd.log"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case $cmd in
up) (
    flock 9
    up "$@"
) 9<"$0" ;;
down) (
    flock 9
    down
) 9<"$0" ;;
status) status ;;
env) cat "$D/cluster.env" ;;
exec)
    [ $# -ge 2 ] || die "exec NODE CMD..."
    node=$1
    shift
    in_node "$node" "$@"
    ;;
lose)
    [ $# -eq 2 ] || die "lose NODE kill|link"
    lose "$@"
    ;;
revive)
    [ $# -eq 1 ] || die "revive NODE"
    revive "$1"
    ;;
*)
    sed -n '2,17p' "$0" >&2
    exit 2
    ;;
esac
