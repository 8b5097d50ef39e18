#!/usr/bin/env bash
# Usage: launch/multinode_deepspeed.sh HOSTFILE [dsrl.main overrides...]
#        NODE_RANK=<n> launch/multinode_deepspeed.sh --no-ssh HOSTFILE [dsrl.main overrides...]
#
# Trainer ranks on every node of HOSTFILE (DeepSpeed hostfile: "<host> slots=<ranks>", see
# launch/hostfile), started over ssh by DeepSpeed's launcher from this node (pdsh; passwordless ssh
# to every host, this one included). Each rank runs `python -m dsrl.main <overrides>` with this
# checkout's interpreter, in this checkout's path (the same on every host). An ssh session starts
# with a fresh environment: the ranks get this shell's PATH (the interpreter's folder first),
# LD_LIBRARY_PATH, TMPDIR and every variable named DSRL_*, DS_*, RAY_*, GLOO_*, NCCL_*, HF_*,
# TRANSFORMERS_*, TOKENIZERS_*, TORCH_*, OMP_*, MKL_*, VLLM_*, WANDB_*, HYDRA_*, PYTHON* set here
# (the same value on every host: GLOO_SOCKET_IFNAME must name an interface every host has), but
# not DSRL_NODE_ADDR and RAY_NODE_IP (each host's own); ~/.deepspeed_env and ./.deepspeed_env
# lines are added and win.
#   launch/multinode_deepspeed.sh launch/hostfile +exp=grpo_reuse actor.zero_stage=3
# --no-ssh: no ssh at all; run the same command on every node of HOSTFILE with NODE_RANK set to
# that node's line in HOSTFILE (0 = the first). It runs DeepSpeed's per-node launcher
# (deepspeed.launcher.launch, what `deepspeed --no_ssh --node_rank N` starts) in a session of its
# own and waits for it; a SIGTERM/SIGINT to this script (or to its process group: Ctrl-C, kill -TERM
# -- -PGID) goes to the rank processes alone, which finish the step, write a checkpoint, stop their
# engines and exit (a stop flag on any rank stops all ranks on all nodes after the same step); the
# script returns when they are done. (`deepspeed --no_ssh` itself exits on a signal at once, leaving
# the ranks running; DeepSpeed's launcher passes a signal on to every process under a rank, vLLM's
# engine processes included, which then die before the checkpoint.) A batch system that signals
# every process of the job (SLURM's scancel) reaches the engines too. The first host
# must be an address every node reaches (MASTER_ADDR); the arguments must be the same on every
# node. Without RUN_DIR the run folder is rank 0's default (outputs/<date>/<time>-<name> under the
# checkout; dsrl/distributed/run_dir.py), as every node would compute its own date.
#   NODE_RANK=0 launch/multinode_deepspeed.sh --no-ssh launch/hostfile +exp=grpo_reuse   # on host 0
#   NODE_RANK=1 launch/multinode_deepspeed.sh --no-ssh launch/hostfile +exp=grpo_reuse   # on host 1
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
NO_SSH=0
if [ "$1" = "--no-ssh" ]; then
  NO_SSH=1; shift
  [ $# -ge 1 ] || usage
fi
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

# Wait for $LAUNCHER (a signal trap may interrupt `wait`) and exit with its status.
wait_launcher() {
  while :; do
    RC=0; wait "$LAUNCHER" || RC=$?
    kill -0 "$LAUNCHER" 2>/dev/null || break  # wait returned for a signal: the launcher still runs
  done
  exit "$RC"
}

cd "$ROOT"
if [ "$NO_SSH" = 1 ]; then
  NHOSTS=$(echo "$HOSTS" | wc -l)
  [[ "${NODE_RANK:-}" =~ ^[0-9]+$ ]] && [ "$NODE_RANK" -lt "$NHOSTS" ] \
    || { echo "error: --no-ssh needs NODE_RANK=<0..$((NHOSTS - 1))> (this node's line in '$HOSTFILE')" >&2; exit 2; }
  RUN_ARGS=()
  [ -z "${RUN_DIR:-}" ] || RUN_ARGS=("hydra.run.dir=$RUN_DIR")
  echo "node $NODE_RANK of $NHOSTS ($(echo "$HOSTS" | sed -n "$((NODE_RANK + 1))p")), no ssh | master $MASTER_ADDR:$MASTER_PORT" \
       "| run dir ${RUN_DIR:-that of rank 0}"
  # The python that runs the deepspeed command; the world as `deepspeed` itself encodes it.
  PY="$(head -n 1 "$DEEPSPEED" | sed -n 's/^#! *//p')"
  [ -x "${PY%% *}" ] || PY="$(command -v python3)"
  WORLD_INFO=$($PY -c 'import sys
from deepspeed.launcher.runner import encode_world_info, fetch_hostfile
print(encode_world_info({h: list(range(n)) for h, n in fetch_hostfile(sys.argv[1]).items()}))' "$HOSTFILE" 2>/dev/null)
  # The launcher in a session of its own: a signal to this script's process group (Ctrl-C, kill
  # -TERM -- -PGID) reaches this script alone, which passes it on to the ranks and to nothing else,
  # neither their engine processes (which the rank stops after its checkpoint) nor DeepSpeed's
  # launcher (which would pass it on to every process under each rank).
  setsid $PY -u -m deepspeed.launcher.launch --world_info="$WORLD_INFO" --node_rank="$NODE_RANK" \
    --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" --module dsrl.main ${RUN_ARGS[@]+"${RUN_ARGS[@]}"} "$@" &
  LAUNCHER=$!
  trap 'pkill -TERM -P "$LAUNCHER" || true' TERM
  trap 'pkill -INT -P "$LAUNCHER" || true' INT
  wait_launcher
fi
RUN_DIR="${RUN_DIR:-$ROOT/outputs/multinode-$(date +%Y%m%d-%H%M%S)}"
echo "trainer ranks on: $(echo "$HOSTS" | tr '\n' ' ')| master $MASTER_ADDR:$MASTER_PORT | run dir $RUN_DIR"
# What the ranks' ssh sessions export: DeepSpeed's runner reads "NAME=value" lines from DS_ENV_FILE
# (a private file, removed on exit; it replaces ~/.deepspeed_env and ./.deepspeed_env, copied last).
ENV_FILE="$(mktemp)"
trap 'rm -f "$ENV_FILE"' EXIT
PY_DIR="$(dirname "$(head -n 1 "$DEEPSPEED" | sed -n 's/^#! *//p' | cut -d' ' -f1)")"
{
  echo "PATH=$PY_DIR:$PATH"
  env | grep -E '^(LD_LIBRARY_PATH|TMPDIR|(DSRL|DS|RAY|GLOO|NCCL|HF|TRANSFORMERS|TOKENIZERS|TORCH|OMP|MKL|VLLM|WANDB|HYDRA)_[A-Za-z0-9_]*|PYTHON[A-Za-z0-9_]*)=' \
    | grep -vE '^(DSRL_NODE_ADDR|RAY_NODE_IP|DS_ENV_FILE)=' || true
  cat ~/.deepspeed_env ./.deepspeed_env 2>/dev/null || true
} > "$ENV_FILE"
# The remote shell reads the values (DeepSpeed quotes them in "..."): one it would expand is left out.
for name in $(grep -E '["$`\\]' "$ENV_FILE" | cut -d= -f1); do
  echo "warning: $name not passed to the ranks (its value holds \", \$, \` or \\)" >&2
  sed -i "/^$name=/d" "$ENV_FILE"
done
DS_ENV_FILE="$ENV_FILE" "$DEEPSPEED" --hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  --module dsrl.main "hydra.run.dir=$RUN_DIR" "$@" &
LAUNCHER=$!
# DeepSpeed's runner stops the ranks on every host (pdsh, pkill) on SIGTERM/SIGINT.
trap 'kill -TERM "$LAUNCHER" 2>/dev/null || true' TERM
trap 'kill -INT "$LAUNCHER" 2>/dev/null || true' INT
wait_launcher
