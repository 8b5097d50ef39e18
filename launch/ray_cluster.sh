#!/usr/bin/env bash
# Usage: launch/ray_cluster.sh head [--num-gpus N]        start the Ray head on this node
#        launch/ray_cluster.sh worker HEAD_IP [--num-gpus N]   join this node to the head's cluster
#        launch/ray_cluster.sh submit HEAD_IP [--ranks N] [dsrl.main overrides...]
#        launch/ray_cluster.sh stop                         stop Ray on this node
#
# A Ray cluster for Ray-placed rollout engines (rollout.placement=ray): the engines are Ray
# actors in a placement group, on whichever nodes have room. `head` / `worker` run `ray start`
# (port 6379, job server on 8265). Trainer nodes can join with --num-gpus 0 so that engines only
# take the GPUs of the other nodes.
# Two ways to run the trainer against it:
# - the deepspeed launcher (launch/multinode_deepspeed.sh) with
#     rollout.placement=ray rollout.ray_address=HEAD_IP:6379
# - one command through the job server: `submit` runs `ray job submit` with the entrypoint
#   `deepspeed --num_gpus N -m dsrl.main rollout.placement=ray rollout.ray_address=auto ...`
#   (N trainer ranks on the node that runs the job; --ranks 1: plain `python -m dsrl.main`).
#   The job server needs Ray's dashboard extras on the head node: pip install "ray[default]==2.60.0"
#   (with torch pinned); the project's set-up installs plain ray, enough for the deepspeed path.
#   launch/ray_cluster.sh submit 10.0.0.1 --ranks 2 +exp=grpo_reuse rollout.num_engines=4
# The job runs on the head node, in this checkout's path (the same on every node, like the
# deepspeed launcher needs), with the python/deepspeed next to RAY.
# Environment: RAY (default: the venv's ray, else the one on PATH), RAY_PORT (6379),
# RAY_JOB_PORT (8265). RAY_AUTH_MODE=disabled is set unless already set.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2; }
die() { echo "error: $*" >&2; exit 2; }
[ $# -ge 1 ] || usage
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
RAY="${RAY:-$ROOT/.venv/bin/ray}"
[ -x "$RAY" ] || RAY="$(command -v ray || true)"
RAY_PORT="${RAY_PORT:-6379}"
RAY_JOB_PORT="${RAY_JOB_PORT:-8265}"
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
    "$(dirname "$RAY")/python" -c "import ray.dashboard.optional_deps" 2>/dev/null || echo "warning: no" \
      "ray[default] extras here: the job server (and so \`submit\`) is off; the deepspeed path works" >&2
    # shellcheck disable=SC2086
    exec "$RAY" start --head --port="$RAY_PORT" --dashboard-host=0.0.0.0 --dashboard-port="$RAY_JOB_PORT" $OPT ;;
  worker)
    need_ip "${1:-}"; need_ray; HEAD="$1"; shift; OPT=$(gpus_option "$@")
    # shellcheck disable=SC2086
    exec "$RAY" start --address="$HEAD:$RAY_PORT" $OPT ;;
  submit)
    need_ip "${1:-}"; need_ray; HEAD="$1"; shift
    RANKS=1
    if [ "${1:-}" = "--ranks" ]; then
      [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || die "--ranks needs a number >= 1, got '${2:-}'"
      RANKS="$2"; shift 2
    fi
    BIN="$(dirname "$RAY")"
    if [ "$RANKS" = 1 ]; then ENTRY=("$BIN/python" -m dsrl.main)
    else ENTRY=("$BIN/deepspeed" --num_gpus "$RANKS" --module dsrl.main); fi
    # The job runs on the head node in this checkout (same path there; nothing is uploaded).
    exec "$RAY" job submit --address="http://$HEAD:$RAY_JOB_PORT" -- \
      bash -c 'cd "$0" && exec "$@"' "$ROOT" "${ENTRY[@]}" rollout.placement=ray rollout.ray_address=auto "$@" ;;
  stop)
    need_ray; exec "$RAY" stop ;;
  -h|--help) usage ;;
  *) die "unknown command '$CMD' (head | worker | submit | stop)" ;;
esac
