#!/usr/bin/env bash
# Usage: launch/multinode_deepspeed.sh HOSTFILE [dsrl.main overrides...]
#
# Trainer ranks on every node of HOSTFILE (DeepSpeed hostfile: "<host> slots=<ranks>", see
# launch/hostfile), started over ssh by DeepSpeed's launcher from this node. Each rank runs
# `python -m dsrl.main <overrides>`.
#   launch/multinode_deepspeed.sh launch/hostfile +exp=grpo_reuse actor.zero_stage=3
# Rollout engines: colocated (one per rank, the default), or Ray-placed engines shared by all
# ranks: start a Ray cluster first (launch/ray_cluster.sh head / worker) and add
#   rollout.placement=ray rollout.num_engines=<M> rollout.ray_address=<ray head>:6379
# Environment: MASTER_ADDR (default: the first host of HOSTFILE), MASTER_PORT (default 29500),
# RUN_DIR (default outputs/multinode-<date>; must be a folder every node can write, e.g. on a
# shared file system), DEEPSPEED (default: the venv's deepspeed, else the one on PATH).
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2; }
[ $# -ge 1 ] || usage
case "$1" in -h|--help) usage ;; esac
HOSTFILE="$1"; shift
[ -f "$HOSTFILE" ] || { echo "error: hostfile '$HOSTFILE' not found" >&2; exit 2; }
HOSTS=$(grep -v '^[[:space:]]*#' "$HOSTFILE" | awk 'NF { print $1 }')
[ -n "$HOSTS" ] || { echo "error: hostfile '$HOSTFILE' lists no host" >&2; exit 2; }
BAD=$(grep -v '^[[:space:]]*#' "$HOSTFILE" | awk 'NF' | grep -vE '^[^[:space:]]+[[:space:]]+slots=[0-9]+[[:space:]]*$' || true)
[ -z "$BAD" ] || { echo "error: '$HOSTFILE': a host line must read '<host> slots=<n>', got: $BAD" >&2; exit 2; }

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEEPSPEED="${DEEPSPEED:-$ROOT/.venv/bin/deepspeed}"
[ -x "$DEEPSPEED" ] || DEEPSPEED="$(command -v deepspeed || true)"
[ -n "$DEEPSPEED" ] || { echo "error: deepspeed not found (run make setup, or set DEEPSPEED)" >&2; exit 2; }
MASTER_ADDR="${MASTER_ADDR:-$(echo "$HOSTS" | head -n 1)}"
MASTER_PORT="${MASTER_PORT:-29500}"
RUN_DIR="${RUN_DIR:-$ROOT/outputs/multinode-$(date +%Y%m%d-%H%M%S)}"

cd "$ROOT"
echo "trainer ranks on: $(echo "$HOSTS" | tr '\n' ' ')| master $MASTER_ADDR:$MASTER_PORT | run dir $RUN_DIR"
exec "$DEEPSPEED" --hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  --module dsrl.main "hydra.run.dir=$RUN_DIR" "$@"
