#!/usr/bin/env bash
# Create or reuse .venv and install the project with its test extras.
# torch is pinned to the CPU wheel first so nothing pulls GBs of CUDA packages;
# on GPU/NPU machines install your accelerator's torch before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.odyssey-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q "torch==2.13.0"
  fi
  .venv/bin/python -m pip install -q -e ".[test]"
  # compile the estimator's replay loop once (numba caches it beside its source)
  .venv/bin/python -c "from odyssey_megatron.estimator.wakeup_loop import warm_up; warm_up()"
  touch "$stamp"
fi
