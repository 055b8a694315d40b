#!/usr/bin/env bash
# The device check (odyssey_megatron/device_check.py), as-is on a machine with one or more
# GPUs: creates or reuses the venv (VENV, default .venv), installs the torch that matches
# the machine (the CUDA wheel where nvidia-smi sees a GPU, else torch==2.13.0's CPU wheel)
# and the project, then runs every check; each figure is one JSON line, and the exit
# status is non-zero when a check fails. Arguments go to the module (--recipe FILE,
# --repeats N, --only CHECK).
#   bash scripts/device_check.sh --dry-run   lists the checks and installs nothing
# TORCH_INDEX_URL overrides where the CUDA wheel comes from (PyPI's torch==2.13.0 is a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_VERSION=2.13.0
for arg in "$@"; do
  if [ "$arg" = "--dry-run" ]; then
    PY=${PYTHON:-}
    if [ -z "$PY" ]; then
      if [ -x "$VENV/bin/python" ]; then PY="$VENV/bin/python"; else PY=python3; fi
    fi
    exec "$PY" -m odyssey_megatron.device_check "$@"
  fi
done
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
has_torch=$("$PY" -c "import torch; print('cuda' if torch.version.cuda else 'cpu')" 2>/dev/null || echo none)
if [ "$gpus" -gt 0 ] && [ "$has_torch" != cuda ]; then
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
elif [ "$has_torch" = none ]; then
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
fi
if ! "$PY" -c "import odyssey_megatron, megatron.core" 2>/dev/null; then
  "$PY" -m pip install -q -e .
fi
echo "{\"check\": \"setup\", \"gpus\": $gpus, \"torch\": \"$("$PY" -c 'import torch; print(torch.__version__)')\"}"
exec "$PY" -m odyssey_megatron.device_check "$@"
