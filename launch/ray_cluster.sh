#!/usr/bin/env bash
# Usage: launch/ray_cluster.sh head [--num-gpus N]        start the Ray head on this node
#        launch/ray_cluster.sh worker HEAD_IP [--num-gpus N]   join this node to the head's cluster
#        launch/ray_cluster.sh stop                         stop Ray on this node (every Ray process here)
#
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

gpus_option() {  # --num-gpus N -> ray start's option (checked)
  if [ $# -eq 0 ]; then return 0; fi
  [ "$1" = "--num-gpus" ] && [ $# -eq 2 ] || die "expected '--num-gpus N', got: $*"
  [[ "$2" =~ ^[0-9]+$ ]] || die "--num-gpus needs a number, got '$2'"
  echo "--num-gpus=$2"
}
need_ray() { [ -n "$RAY" ] || die "ray not found (run make setup, or set RAY)"; }
need_ip() { [ -n "${1:-}" ] && [[ "$1" != -* ]] || die "$CMD needs the head node's address (HEAD_IP)"; }

CMD="$1"; shift
case "$CMD" in
  head)
    need_ray; OPT=$(gpus_option "$@")
    # shellcheck disable=SC2086
    exec "$RAY" start --head --port="$RAY_PORT" ${NODE_OPTS[@]+"${NODE_OPTS[@]}"} $OPT ;;
  worker)
    need_ip "${1:-}"; need_ray; HEAD="$1"; shift; OPT=$(gpus_option "$@")
    # shellcheck disable=SC2086
    exec "$RAY" start --address="$HEAD:$RAY_PORT" ${NODE_OPTS[@]+"${NODE_OPTS[@]}"} $OPT ;;
  stop)
    need_ray; exec "$RAY" stop ;;
  -h|--help) usage ;;
  *) die "unknown command '$CMD' (head | worker | stop)" ;;
esac
