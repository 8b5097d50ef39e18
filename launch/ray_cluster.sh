#!/usr/bin/env bash
# Usage: launch/ray_cluster.sh head [--num-gpus N] [--block]          start the Ray head on this node
#        launch/ray_cluster.sh worker HEAD_IP [--num-gpus N] [--block]  join this node to the head's cluster
#        launch/ray_cluster.sh wait HEAD_IP NODES [TIMEOUT_S]         wait until NODES nodes are up (120 s)
#        launch/ray_cluster.sh stop                                   stop Ray on this node (every Ray process here)
#
# --block: stay in the foreground while the node's Ray processes run (what a batch system's step
# needs: SLURM ends a step's processes when its command returns); without it `ray start` returns once
# they run. `wait` returns 0 once the cluster at HEAD_IP lists NODES live nodes, else exits 1 after
# TIMEOUT_S naming how many joined.
# A Ray cluster for Ray-placed rollout engines (rollout.placement=ray): the engines are Ray
# actors in a placement group, on whichever nodes have room. `head` / `worker` run `ray start`
# (port 6379). Trainer nodes can join with --num-gpus 0 so that engines only take the GPUs of the
# other nodes. Run the trainer against it with python -m dsrl.main, or with the deepspeed launcher
# (launch/multinode_deepspeed.sh), adding
#     rollout.placement=ray rollout.ray_address=HEAD_IP:6379
# (tests/multinode: a head and a worker on two hosts, an engine placed on each). `ray job submit`
# is not a supported path: it needs Ray's dashboard extras (ray[default]), which set-up does not
# install, and it never ran here.
# Environment: RAY (default: the venv's ray, else the one on PATH), RAY_PORT (6379),
# RAY_NODE_IP (this node's address as the other nodes reach it; default: Ray's guess, which needs
# a default route), RAY_TEMP_DIR (Ray's session folder on this node; default /tmp/ray), RAY_NUM_CPUS
# (the CPUs this node offers; default: all it has).
# RAY_AUTH_MODE=disabled is set unless already set.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2; }
die() { echo "error: $*" >&2; exit 2; }
[ $# -ge 1 ] || usage
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
RAY="${RAY:-$ROOT/.venv/bin/ray}"
[ -x "$RAY" ] || RAY="$(command -v ray || true)"
RAY_PORT="${RAY_PORT:-6379}"
NODE_OPTS=()
[ -z "${RAY_NODE_IP:-}" ] || NODE_OPTS+=("--node-ip-address=$RAY_NODE_IP")
[ -z "${RAY_TEMP_DIR:-}" ] || NODE_OPTS+=("--temp-dir=$RAY_TEMP_DIR")
[ -z "${RAY_NUM_CPUS:-}" ] || NODE_OPTS+=("--num-cpus=$RAY_NUM_CPUS")
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
# On SIGTERM (ray stop; a SLURM job's end) Ray drains a node for up to 30 s before it stops, for Ray
# Serve's proxies. Nothing here serves: with the drain, a finished or failed SLURM job stayed
# COMPLETING ~30 s longer, holding its nodes (tests/multinode, the SLURM job). 0: stop at once.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}"

node_options() {  # [--num-gpus N] [--block] -> ray start's options (checked)
  while [ $# -gt 0 ]; do
    case "$1" in
      --num-gpus)
        [ $# -ge 2 ] || die "expected '--num-gpus N', got: $*"
        [[ "$2" =~ ^[0-9]+$ ]] || die "--num-gpus needs a number, got '$2'"
        echo "--num-gpus=$2"; shift 2 ;;
      --block) echo "--block"; shift ;;
      *) die "expected '--num-gpus N' or '--block', got: $*" ;;
    esac
  done
}
need_ray() { [ -n "$RAY" ] || die "ray not found (run make setup, or set RAY)"; }
need_ip() { [ -n "${1:-}" ] && [[ "$1" != -* ]] || die "$CMD needs the head node's address (HEAD_IP)"; }

CMD="$1"; shift
case "$CMD" in
  head)
    need_ray; OPT=$(node_options "$@")
    # shellcheck disable=SC2086
    exec "$RAY" start --head --port="$RAY_PORT" ${NODE_OPTS[@]+"${NODE_OPTS[@]}"} $OPT ;;
  worker)
    need_ip "${1:-}"; need_ray; HEAD="$1"; shift; OPT=$(node_options "$@")
    # shellcheck disable=SC2086
    exec "$RAY" start --address="$HEAD:$RAY_PORT" ${NODE_OPTS[@]+"${NODE_OPTS[@]}"} $OPT ;;
  wait)
    need_ip "${1:-}"; need_ray; HEAD="$1"
    [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || die "wait needs the number of nodes, got '${2:-}'"
    [[ "${3:-120}" =~ ^[1-9][0-9]*$ ]] || die "wait's TIMEOUT_S must be a number of seconds, got '$3'"
    PY="$(dirname "$RAY")/python"
    [ -x "$PY" ] || PY="$(command -v python3)"
    # One driver polls the head's node table (ray.nodes()): no dashboard needed.
    exec "$PY" - "$HEAD:$RAY_PORT" "$2" "${3:-120}" <<'WAIT'
import sys, time
import ray
address, want, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
end = time.monotonic() + timeout
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
while True:
    alive = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    if len(alive) >= want:
        print(f"ray cluster at {address}: {len(alive)} nodes up ({', '.join(alive)})")
        sys.exit(0)
    if time.monotonic() > end:
        print(f"error: ray cluster at {address}: {len(alive)} of {want} nodes up after {timeout:.0f} s "
              f"({', '.join(alive) or 'none'})", file=sys.stderr)
        sys.exit(1)
    time.sleep(0.5)
WAIT
    ;;
  stop)
    need_ray; exec "$RAY" stop ;;
  -h|--help) usage ;;
  *) die "unknown command '$CMD' (head | worker | wait | stop)" ;;
esac
