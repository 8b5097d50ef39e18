#!/usr/bin/env bash
# Usage: launch/netns_two_nodes.sh create NAME ROOT | sshd NAME | slurm NAME | exec NAME NODE CMD... | destroy NAME | sweep
#
# Two "hosts" on this machine (root only): network namespaces NAME-0 and NAME-1 joined by a veth
# pair, node 0 at 10.77.0.1/24 and node 1 at 10.77.0.2/24 (loopback up in each; nothing outside
# this machine is reachable from them), and a node-local disk per node: ROOT/node0 and ROOT/node1,
# each seen by its node's processes at the same path, ROOT/local (a bind mount in a mount
# namespace of its own), as a real cluster's node-local scratch is one path on every host.
#   create NAME ROOT      make both namespaces, the veth pair (one interface name, veth2n, inside
#                         both, as a cluster's hosts share theirs) and ROOT/{local,node0,node1}; prints
#                         "<ns0> <ns1> <if0> <if1> <addr0> <addr1>"
#   sshd NAME             an sshd on each node, on its address, port 22 (host keys, config, pid file
#                         under ROOT/ssh; key-only root login); every node's ssh client (of processes
#                         started by exec from then on, and of ssh sessions) logs in to either node
#                         with ROOT/ssh/id_ed25519 and checks ROOT/ssh/known_hosts: `ssh 10.77.0.2`,
#                         pdsh -R ssh. ssh sessions run on their node as exec runs CMD (host name,
#                         ROOT/local, GLOO_SOCKET_IFNAME, DSRL_NODE_ADDR)
#   slurm NAME            a SLURM cluster of the two nodes (apt-get install slurmctld slurmd
#                         slurm-client munge): munged (its own key) and slurmctld on node 0, a slurmd
#                         on each (node names = host names, spool and logs on each node's disk),
#                         configuration in ROOT/slurm/etc, /etc/slurm on the nodes; returns once both
#                         nodes are idle. `exec NAME 0 sbatch --nodes=2 ...` submits a job
#   exec NAME NODE CMD..  run CMD on node NODE (0 or 1): in its namespace, host name NAME-NODE,
#                         ROOT/local = ROOT/nodeNODE, GLOO_SOCKET_IFNAME = its veth, DSRL_NODE_ADDR =
#                         its address, /etc/hosts naming both nodes; once sshd ran,
#                         /etc/ssh/ssh_config.d = ROOT/ssh/client.d; once slurm ran, /etc/slurm
#   destroy NAME          kill what still runs in the namespaces, delete them (the veth pair goes
#                         with them); leaves ROOT to its owner. Safe to repeat.
#   sweep                 destroy every dsrl2n-PID-* whose creator PID is gone (a crashed run's)
# NAME must read dsrl2n-<creator pid>-<tag> (<tag>: up to 6 letters/digits); the veth ends are
# created under names derived from it (15 characters at most), then renamed veth2n in each namespace. Example, the two-node DeepSpeed launch of
# tests/multinode (one rank per node, no ssh; see docs/guides/multi-node.md):
#   launch/netns_two_nodes.sh create dsrl2n-$$-a /tmp/two
#   launch/netns_two_nodes.sh exec dsrl2n-$$-a 0 env NODE_RANK=0 MASTER_ADDR=10.77.0.1 \
#     launch/multinode_deepspeed.sh --no-ssh HOSTFILE +exp=grpo_reuse ... &   # and node 1 with NODE_RANK=1
#   launch/netns_two_nodes.sh destroy dsrl2n-$$-a
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2; }
die() { echo "netns_two_nodes: $*" >&2; exit 1; }
ADDR=(10.77.0.1 10.77.0.2)
VETH=veth2n  # each veth end's name inside its namespace

check_name() {
  [[ "$1" =~ ^dsrl2n-([0-9]+)-([A-Za-z0-9]{1,6})$ ]] || die "name '$1' must read dsrl2n-<pid>-<tag> (tag: 1-6 letters/digits)"
  PID_OF_NAME="${BASH_REMATCH[1]}"; TAG="${BASH_REMATCH[2]}"
  # Interface names: "d" + last 6 digits of the pid + tag + "v0"/"v1" <= 15 characters.
  local p; p="$(printf '%06d' "$PID_OF_NAME")"; p="${p: -6}"
  IF=("d${p}${TAG}v0" "d${p}${TAG}v1")
  NS=("$1-0" "$1-1")
}

STATE=/run/dsrl2n  # NAME.root: the ROOT of each live pair
root_of() { cat "$STATE/$1.root" 2>/dev/null || true; }

create() {
  local name="$1" root="$2"
  check_name "$name"
  [ "$(id -u)" = 0 ] || die "needs root (ip netns add)"
  mkdir -p "$root/local" "$root/node0" "$root/node1"
  root="$(cd "$root" && pwd)"
  [ ! -e "/run/netns/${NS[0]}" ] && [ ! -e "/run/netns/${NS[1]}" ] || die "namespaces '$name' exist already"
  trap 'destroy "$name" >/dev/null 2>&1 || true' EXIT  # a failure below leaves nothing behind
  mkdir -p "$STATE"
  echo "$root" > "$STATE/$name.root"
  ip netns add "${NS[0]}"
  ip netns add "${NS[1]}"
  ip link add "${IF[0]}" type veth peer name "${IF[1]}"
  for i in 0 1; do
    ip link set "${IF[$i]}" netns "${NS[$i]}"
    ip -n "${NS[$i]}" link set "${IF[$i]}" name "$VETH"
    ip -n "${NS[$i]}" link set lo up
    ip -n "${NS[$i]}" addr add "${ADDR[$i]}/24" dev "$VETH"
    ip -n "${NS[$i]}" link set "$VETH" up
  done
  # Each node resolves both host names (a cluster's DNS or /etc/hosts): this file is /etc/hosts on
  # the nodes (bound by exec).
  { grep -v "dsrl2n-" /etc/hosts 2>/dev/null || echo "127.0.0.1 localhost"
    echo "${ADDR[0]} ${NS[0]}"; echo "${ADDR[1]} ${NS[1]}"; } > "$root/hosts"
  trap - EXIT
  echo "${NS[0]} ${NS[1]} $VETH $VETH ${ADDR[0]} ${ADDR[1]}"
}

start_sshd() {
  local name="$1"
  check_name "$name"
  local root; root="$(root_of "$name")"
  [ -n "$root" ] || die "no namespaces '$name' (run create first)"
  local sshd; sshd="$(command -v sshd || echo /usr/sbin/sshd)"
  [ -x "$sshd" ] && command -v ssh-keygen >/dev/null || die "sshd or ssh-keygen not found (apt-get install openssh-server)"
  local d="$root/ssh" i
  rm -rf "$d" && mkdir -p "$d/client.d" && chmod 700 "$d"
  mkdir -p /run/sshd  # sshd's privilege separation folder
  ssh-keygen -q -t ed25519 -N '' -C "dsrl2n client $name" -f "$d/id_ed25519"
  cp "$d/id_ed25519.pub" "$d/authorized_keys"
  : > "$d/known_hosts"
  for i in 0 1; do
    mkdir -p "$d/node$i"
    ssh-keygen -q -t ed25519 -N '' -C "dsrl2n host ${NS[$i]}" -f "$d/node$i/ssh_host_ed25519_key"
    echo "${ADDR[$i]},${NS[$i]} $(cut -d' ' -f1,2 "$d/node$i/ssh_host_ed25519_key.pub")" >> "$d/known_hosts"
    # SetEnv: an ssh session gets what exec gives CMD (sshd passes its own environment to no session).
    cat > "$d/node$i/sshd_config" <<CONF
ListenAddress ${ADDR[$i]}:22
HostKey $d/node$i/ssh_host_ed25519_key
PidFile $d/node$i/sshd.pid
AuthorizedKeysFile $d/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
SetEnv GLOO_SOCKET_IFNAME=$VETH DSRL_NODE_ADDR=${ADDR[$i]}
CONF
  done
  cat > "$d/client.d/dsrl2n.conf" <<CONF
Host ${ADDR[0]} ${ADDR[1]} ${NS[0]} ${NS[1]}
  User root
  IdentityFile $d/id_ed25519
  IdentitiesOnly yes
  UserKnownHostsFile $d/known_hosts
  StrictHostKeyChecking yes
  BatchMode yes
CONF
  # Started through exec: sshd and every session it opens live in the node's namespaces (its
  # network, host name, ROOT/local, ssh client configuration).
  for i in 0 1; do
    "$0" exec "$name" "$i" "$sshd" -f "$d/node$i/sshd_config" || die "sshd on node $i did not start"
  done
  for i in 0 1; do
    "$0" exec "$name" 0 ssh "${ADDR[$i]}" true || die "ssh from node 0 to ${ADDR[$i]} failed"
  done
}

start_slurm() {
  local name="$1" i t
  check_name "$name"
  local root; root="$(root_of "$name")"
  [ -n "$root" ] || die "no namespaces '$name' (run create first)"
  for t in munged slurmctld slurmd sinfo sbatch srun scontrol; do
    command -v "$t" >/dev/null || die "$t not found (apt-get install slurmctld slurmd slurm-client munge)"
  done
  local d="$root/slurm"
  rm -rf "$d" && mkdir -p "$d/etc" "$d/state" "$d/munge/key"
  # munged's checks: its socket's folder searchable by all, its key private.
  chmod 755 "$d" "$d/munge" && chmod 700 "$d/munge/key"
  head -c 1024 /dev/urandom > "$d/munge/key/munge.key" && chmod 600 "$d/munge/key/munge.key"
  cat > "$d/etc/slurm.conf" <<CONF
# Two nodes, ${NS[0]} (controller too) and ${NS[1]}, root-run daemons, no accounting, no cgroups.
ClusterName=dsrl2n
SlurmctldHost=${NS[0]}(${ADDR[0]})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$d/munge/socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$d/state
SlurmctldPidFile=$d/slurmctld.pid
SlurmctldLogFile=$d/slurmctld.log
# On each node's own disk (ROOT/local is ROOT/nodeN there).
SlurmdSpoolDir=$root/local/slurmd
SlurmdPidFile=$root/local/slurmd.pid
SlurmdLogFile=$root/local/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
NodeName=${NS[0]} NodeAddr=${ADDR[0]} CPUs=$(nproc)
NodeName=${NS[1]} NodeAddr=${ADDR[1]} CPUs=$(nproc)
PartitionName=nodes Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
  echo "CgroupPlugin=cgroup/v1" > "$d/etc/cgroup.conf"
  for i in 0 1; do mkdir -p "$root/node$i/slurmd"; done
  # Each daemon through exec: /etc/slurm there is ROOT/slurm/etc; destroy kills them all.
  "$0" exec "$name" 0 munged --key-file="$d/munge/key/munge.key" --socket="$d/munge/socket" \
    --pid-file="$d/munge/munged.pid" --log-file="$d/munge/munged.log" --seed-file="$d/munge/key/seed" \
    || die "munged did not start ($d/munge/munged.log)"
  "$0" exec "$name" 0 slurmctld || die "slurmctld did not start ($d/slurmctld.log)"
  # slurmd loads its cgroup plugin even without cgroup task or process tracking, and `ip netns
  # exec` remounts /sys without the machine's cgroup mounts: each node gets a freezer hierarchy.
  for i in 0 1; do
    "$0" exec "$name" "$i" bash -c 'mount -t tmpfs dsrl2n-cgroup /sys/fs/cgroup && mkdir /sys/fs/cgroup/freezer &&
      mount -t cgroup -o freezer dsrl2n-freezer /sys/fs/cgroup/freezer && exec slurmd -N "$1"' _ "${NS[$i]}" \
      || die "slurmd on node $i did not start ($root/node$i/slurmd.log)"
  done
  for _ in $(seq 150); do
    [ "$("$0" exec "$name" 0 sinfo -h -o '%D %T' 2>/dev/null)" = "2 idle" ] && return 0
    sleep 0.2
  done
  die "the two slurmd did not register as idle within 30 s: $("$0" exec "$name" 0 sinfo 2>&1)"
}

run_on() {
  local name="$1" node="$2"; shift 2
  check_name "$name"
  [[ "$node" =~ ^[01]$ ]] || die "node must be 0 or 1, got '$node'"
  local root; root="$(root_of "$name")"
  [ -n "$root" ] || die "no namespaces '$name' (run create first)"
  # `ip netns exec` gives the command a mount namespace of its own: the bind mount stays in it;
  # `unshare --uts`: a host name of its own (the namespace's name), as a real host has.
  # After `sshd`: this node's ssh client configuration (key, known hosts) as the system's.
  exec ip netns exec "${NS[$node]}" env GLOO_SOCKET_IFNAME="$VETH" DSRL_NODE_ADDR="${ADDR[$node]}" \
    unshare --uts bash -c 'hostname "$1" && mount --bind "$2" "$3" &&
      { [ ! -d "$4" ] || [ ! -d /etc/ssh/ssh_config.d ] || mount --bind "$4" /etc/ssh/ssh_config.d; } &&
      { [ ! -f "$5" ] || mount --bind "$5" /etc/hosts; } &&
      { [ ! -d "$6" ] || { mkdir -p /etc/slurm && mount --bind "$6" /etc/slurm; }; } &&
      shift 6 && exec "$@"' _ "${NS[$node]}" "$root/node$node" "$root/local" "$root/ssh/client.d" "$root/hosts" \
      "$root/slurm/etc" "$@"
}

destroy() {
  local name="$1"
  check_name "$name"
  local ns pid
  for ns in "${NS[@]}"; do
    [ -e "/run/netns/$ns" ] || continue
    # Only processes inside this run's own namespaces: a run's leftovers, never anything else.
    for _ in 1 2 3; do
      pids=$(ip netns pids "$ns" 2>/dev/null || true)
      [ -n "$pids" ] || break
      for pid in $pids; do kill -9 "$pid" 2>/dev/null || true; done
      sleep 0.2
    done
    ip netns delete "$ns" 2>/dev/null || true
  done
  rm -f "$STATE/$name.root"
}

sweep() {
  local name
  for name in $(ip netns list 2>/dev/null | awk '{ print $1 }' | grep -E '^dsrl2n-[0-9]+-[A-Za-z0-9]+-[01]$' \
                | sed 's/-[01]$//' | sort -u || true); do
    check_name "$name"
    if ! kill -0 "$PID_OF_NAME" 2>/dev/null; then
      echo "netns_two_nodes: removing $name (its creator, pid $PID_OF_NAME, is gone)" >&2
      destroy "$name"
    fi
  done
}

[ $# -ge 1 ] || usage
cmd="$1"; shift
case "$cmd" in
  create) [ $# -eq 2 ] || usage; create "$@" ;;
  sshd) [ $# -eq 1 ] || usage; start_sshd "$1" ;;
  slurm) [ $# -eq 1 ] || usage; start_slurm "$1" ;;
  exec) [ $# -ge 3 ] || usage; run_on "$@" ;;
  destroy) [ $# -eq 1 ] || usage; destroy "$1" ;;
  sweep) [ $# -eq 0 ] || usage; sweep ;;
  -h|--help) usage ;;
  *) usage ;;
esac
