#!/usr/bin/env bash
# Set up (if needed) and run the main job: the tiny Llama-2 recipe on 8 CPU ranks with a
# rank killed in step 5 and another hung in step 12; prints the recovery summary and the
# offline W&B run's directory.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/odyssey train --config recipes/llama2_7b/tiny_cpu.yaml \
    'odyssey.faults=[{rank: 5, step: 5, phase: backward, action: kill}, {rank: 2, step: 12, phase: forward, action: stop}]'
