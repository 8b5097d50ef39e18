#!/usr/bin/env bash
# GPU smoke checks, two levels (docs/guides/gpu.md), each under 10 minutes on one GPU:
#   launch/gpu_smoke.sh trainer   torch (CUDA) + deepspeed + hydra-core + omegaconf + transformers:
#                                 ZeRO-2/3 on cuda:LOCAL_RANK, the ZeRO-3 export, a two-process
#                                 CUDA IPC round trip, GRPO steps with rollout.backend=hf in bf16
#   launch/gpu_smoke.sh vllm      vLLM for CUDA (vllm==0.33.0): engine start, sync through CUDA IPC,
#                                 trainer/vLLM log-prob agreement before and after sync, sleep/wake
# Both print PASS/FAIL lines and FIGURE lines (step time, tokens/s, sync time); logs go to $OUT
# (default: a temp folder). Exit codes: 0 all checks passed, or no CUDA device ("no CUDA device:
# skipped"); 1 a check failed; 2 usage. PYTHON picks the interpreter (default: .venv/bin/python
# if present, else python3). Run it from anywhere.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
LEVEL="${1:-}"
case "$LEVEL" in
  trainer) SCRIPT="$ROOT/tests/gpu/trainer_smoke.py" ;;
  vllm) SCRIPT="$ROOT/tests/gpu/vllm_smoke.py" ;;
  *) echo "usage: $0 trainer|vllm" >&2; exit 2 ;;
esac
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "no CUDA device: skipped ($LEVEL level; torch sees no GPU)"
  exit 0
fi
OUT="${OUT:-$(mktemp -d -t dsrl-gpu-smoke-XXXXXX)}"
mkdir -p "$OUT"
export OUT DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/torch_extensions}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
START=$SECONDS
cd "$ROOT" && "$PYTHON" "$SCRIPT" 2>&1 | tee "$OUT/$LEVEL.log"
RC=${PIPESTATUS[0]}
echo "[gpu_smoke] $LEVEL: exit $RC in $((SECONDS - START)) s; log: $OUT/$LEVEL.log"
grep -E '^(PASS|FAIL|SKIP|FIGURE|SUMMARY)' "$OUT/$LEVEL.log" > "$OUT/$LEVEL.summary.txt" || true
exit "$RC"
